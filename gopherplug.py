"""gopherplug: a Kubernetes device plugin in one module, and a lesson in the protocol.

The kubelet learns about hardware from device plugins. A plugin serves the DevicePlugin gRPC API
(v1beta1) on a unix socket in the kubelet's device-plugin directory, registers through the kubelet's
own socket there, streams its device list, and tells the kubelet what a container needs for the
devices it was given. This file does all of that with trio, purerpc, protobuf and inotify. With a
``dra`` section it is also a Dynamic Resource Allocation driver, for Kubernetes 1.34 or later (it
speaks resource.k8s.io/v1).

New to device plugins? Read the five lessons in examples/lesson/ first, in order: gopher_devices.py,
gopher_plugin.py, gopher_allocation.py, gopher_dra.py, gopher_claims.py (the protocols, device plugin
then DRA, in files of at most 250 lines, each with a narrated --demo; docs/protocol.md says what each
teaches, EXERCISES.md checks itself). This module is the real thing.

Read it top to bottom; every section only uses the ones above it:

  1. The kubelet contract      constants, the v1beta1 messages built in code, the service table
                               (and gopherplug's own status service, which the kubelet never calls);
                               DRA's pluginregistration, DRAPlugin and DRAResourceHealth messages
                               the same way
  2. Errors                    one base class, every exception; config errors name the file and key
  3. Model                     frozen dataclasses: Config, ResourceConfig, DeviceEntry
  4. Pure core                 synchronous and deterministic, no logging, nothing written:
     4a. The configuration     YAML -> Config, every mistake one ConfigError; names, DRA's declarations
     4b. Devices, directories  a directory (or USB) -> entries -> devices, healthy or not and why
     4c. The answers           devices + request -> the kubelet's responses; CDI specs
     4d. DRA's pure part       devices -> ResourceSlices; a ResourceClaim -> its prepared devices
     4e. What the node reports NFD labels; who holds a device, from the kubelet's PodResources answer
  5. purerpc on unix sockets   the fenced glue that makes purerpc serve and call like grpc-go
  6. I/O edges                 each piece waits on the kernel, never polls:
     6a. Config file, inotify  the config file, inotify watches, the devices' sources, CDI spec files
     6b. DevicePlugin service  DevicePluginService, Register, kubelet restarts, PodResources' List
     6c. The HTTP server       metrics and the kubelet's liveness check
     6d. DRA, the node side    the registration socket, DRAPlugin, the checkpoint, the slice publisher
     6e. The API server        its client, credentials (token, exec plugin), list and watch
  7. Orchestration             serve_plugin: the nursery tree, kubelet restarts, configuration reloads
  8. A kubelet simulator       the kubelet's device manager in miniature; probe and demo; its DRA
                               side and a lenient API server, what the DRA demo needs (the strict
                               stand-ins that only tests need are in gopherplug_standins.py)
  9. Command line              main(argv) -> exit code; signals
 10. Start-up plumbing         how `python gopherplug.py` starts again as an import (not the protocol)

Or take one of two paths through it, definitions to read in order (search for the name). Both
skip section 5, the purerpc plumbing, but for Watched: what else the rest uses of it (serve_grpc,
call_unary, open_stream) does what its name says. Both skip section 10, and the speed-ups
(_ImmediateService, _ListEncoder, _PreferredOrder, _PreferredAllocationWire): the answers are the
same without them.

  The device-plugin path
     1. METHODS, REGISTER              the v1beta1 calls the plugin serves, and the one it makes
     2. ResourceConfig, DeviceEntry    a resource as configured; one device and its health
     3. parse_config                   YAML -> Config, every mistake one ConfigError
     4. scan_directory, examine_entry  a directory -> entries -> devices, healthy or not and why
     5. list_and_watch_response,       the answers, as pure functions of the devices
        allocate_response,
        preferred_allocation_response
     6. Watched, watch_devices         inotify keeps the devices current, with no polling
     7. DevicePluginService            one method per RPC: GetDevicePluginOptions, ListAndWatch,
                                       GetPreferredAllocation, Allocate, PreStartContainer
     8. register                       Register, through the kubelet's kubelet.sock
     9. KubeletWatch,                  the restart handling: a kubelet restart creates a new
        _serve_generations             kubelet.sock; each one gets a new socket and registration
    10. serve_plugin, register_again   the nursery tree; reloads in place or anew
    11. KubeletSimulator               the kubelet's side, as the tests and the demo drive it

  The DRA path (after steps 1-6 above)
     1. DRA_METHODS, drapb,            the kubelet's DRAPlugin and plugin-registration calls
        pluginregistration
     2. DraConfig, dra_device,         devices -> this node's ResourceSlices, a pool per resource
        resource_slices
     3. prepared_devices               a ResourceClaim's results -> its devices and CDI names
     4. registration_service,          the registration socket; DRAPlugin and DRAResourceHealth on
        dra_plugin_services            the driver's own socket
     5. ClaimPreparer, ClaimCheckpoint NodePrepareResources and NodeUnprepareResources, remembered
     6. KubeApi, SlicePublisher        the API server; the slice publisher, one pool at a time
        DriverPeers, CDISpecTurn       a rolling update's newest pod writes the slices and CDI specs
     7. serve_dra, _keep_serving       the driver's sockets, served again when the kubelet wipes them
     8. DraKubeletSimulator,           the kubelet's DRA side and an API server, in miniature
        LenientApiServer

The public API is __all__, what docs/embedding.md's "The public API" lists too (a test keeps the
three equal). A minor version (0.x) keeps it, or says in CHANGELOG.md what it changes and why;
every other name, underscored or not, may change in any release.

  Run it             main, serve_plugin, serve_devices, serve_dra_devices, serve_dra,
                     serve_until_signalled, STOP_TIMEOUT
  Configure it       load_config, parse_config, resource_config, find_device_plugin_dir, Config,
                     ResourceConfig, DraConfig, DeviceSpecTemplate, UsbSelector, DeclaredValue
  Devices            DeviceEntry, Watched, ShapeAllocation, ContainerAllocateResponse, HEALTHY,
                     UNHEALTHY, scan_directory, find_usb_devices, UsbDevice
  Answers (pure)     list_and_watch_response, allocate_response, preferred_allocation_response,
                     resource_slices, prepared_devices, dra_device_name, dra_pool_name,
                     dra_health_response, device_attributes, device_capacity
  Kubernetes API     KubeApi, ApiError, DraDriver, DraResources, ClaimCheckpoint
  Errors             GopherplugError, ConfigError, RPCError, ClaimError, StatusCode,
                     UnexpectedAdmissionError
  The wire           API_VERSION, KUBELET_SOCKET, DEFAULT_DEVICE_PLUGIN_DIR, FILE_DESCRIPTOR,
                     METHODS, REGISTER, DRA_METHODS, GET_STATUS, Method, v1beta1, drapb, drahealth,
                     pluginregistration, serve_grpc, GRPCServer, call_unary, open_stream
  Stand-ins          KubeletSimulator, DraKubeletSimulator, PodResourcesSimulator, LenientApiServer

Quick start:

    pip install .
    gopherplug demo                                       # the protocol, narrated, no cluster needed
    gopherplug check-config --config config.example.yaml
    gopherplug serve --config config.example.yaml         # then: gopherplug probe
"""

from __future__ import annotations

import os
import sys

# Start-up plumbing, not the protocol: `python gopherplug.py` starts again, before any other import,
# as an import of this file (_run_as_module, section 10 at the end, says why and how). The script is
# compiled whole before its first line runs, so the function is taken from the module's code now.
# The interpreter was started on this file (python [options] gopherplug.py args): a file loader and
# no module spec; -m has a spec, runpy.run_path neither.
if __name__ == "__main__" and __spec__ is None:
    if type(sys.modules[__name__].__loader__).__name__ == "SourceFileLoader":
        _code = next(c for c in sys._getframe().f_code.co_consts if getattr(c, "co_name", "") == "_run_as_module")
        type(lambda: None)(_code, globals())(__file__)  # a function of that code: _run_as_module(__file__)

import argparse
import base64
import bisect
import collections
import contextlib
import contextvars
import ctypes
import dataclasses
import datetime
import errno
import fcntl
import fnmatch
import functools
import hashlib
import http
import inspect
import itertools
import json
import logging
import math
import queue
import random
import re
import shutil
import signal
import socket
import stat
import string
import subprocess
import tempfile
import threading
import time
import types
import urllib.parse
import zlib
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Generator,
    Iterable,
    Iterator,
    Mapping,
    MutableMapping,
)
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

import anyio
import h2.errors
import h2.events
import h2.exceptions
import h2.frame_buffer
import h2.settings
import trio
import yaml
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError
from inotify_simple import INotify, flags

# purerpc 0.8.0 names h2 3's PingAcknowledged event, which h2 4.0 renamed PingAckReceived; without
# the old name purerpc cannot even be imported under h2 4. The alias only adds a name to h2.events
# (the same class under both), so other h2 users in the process (httpx, grpclib) see no change.
# Section 5 lists every h2 and purerpc internal the glue relies on, for both h2 3.2 and 4.x.
if "PingAcknowledged" not in vars(h2.events):
    vars(h2.events)["PingAcknowledged"] = h2.events.PingAckReceived

import purerpc  # after the alias above
from purerpc.grpc_proto import GRPCProtoSocket, GRPCProtoStream
from purerpc.grpc_socket import SocketWrapper
from purerpc.grpclib.buffers import MessageReadBuffer
from purerpc.grpclib.config import GRPCConfiguration
from purerpc.grpclib.connection import GRPCConnection
from purerpc.grpclib.events import MessageReceived, RequestEnded, RequestReceived, WindowUpdated
from purerpc.grpclib.exceptions import (
    MessageTooLargeError,
    ProtocolError,
    RpcFailedError,
    UnsupportedMessageEncodingError,
)
from purerpc.grpclib.headers import HeaderDict
from purerpc.grpclib.status import Status, StatusCode
from purerpc.wrappers import extract_message_from_singleton_stream

__version__ = "0.1.0"

# fmt: off
__all__ = [  # sorted (ruff RUF022); grouped by purpose in the docstring above
    "API_VERSION", "DEFAULT_DEVICE_PLUGIN_DIR", "DRA_METHODS", "FILE_DESCRIPTOR", "GET_STATUS", "HEALTHY",
    "KUBELET_SOCKET", "METHODS", "REGISTER", "STOP_TIMEOUT", "UNHEALTHY", "ApiError", "ClaimCheckpoint", "ClaimError",
    "Config", "ConfigError", "ContainerAllocateResponse", "DeclaredValue", "DeviceEntry", "DeviceSpecTemplate",
    "DraConfig", "DraDriver", "DraKubeletSimulator", "DraResources", "GRPCServer", "GopherplugError", "KubeApi",
    "KubeletSimulator", "LenientApiServer", "Method", "PodResourcesSimulator", "RPCError", "ResourceConfig",
    "ShapeAllocation", "StatusCode", "UnexpectedAdmissionError", "UsbDevice", "UsbSelector", "Watched",
    "allocate_response", "call_unary", "device_attributes", "device_capacity", "dra_device_name", "dra_health_response",
    "dra_pool_name", "drahealth", "drapb", "find_device_plugin_dir", "find_usb_devices", "list_and_watch_response",
    "load_config", "main", "open_stream", "parse_config", "pluginregistration", "preferred_allocation_response",
    "prepared_devices", "resource_config", "resource_slices", "scan_directory", "serve_devices", "serve_dra",
    "serve_dra_devices", "serve_grpc", "serve_plugin", "serve_until_signalled", "v1beta1",
]
# fmt: on

log = logging.getLogger("gopherplug")


class _ResourceLog(logging.LoggerAdapter[logging.Logger]):
    """The log of one resource: each message begins with the resource's name ("example.com/gopher:
    allocated g1"), and the record carries it in ``record.resource`` too.

    In the message itself, because an embedding program formats the records with its own handlers
    (logging.basicConfig, a JSON formatter of its own) that know nothing of ``resource``: a line
    without the name would not say which of its resources it is about. _LogFormatter, which has the
    field, leaves the text as it is and takes the name out of a JSON line's message, where the
    field holds it. A resource name has no "%" (resource_name_problem), so the prefix cannot disturb
    the message's own %-formatting."""

    def __init__(self, resource_name: str) -> None:
        super().__init__(log, {"resource": resource_name})
        self.resource_name = resource_name

    def process(
        self, msg: Any, kwargs: collections.abc.MutableMapping[str, Any]
    ) -> tuple[Any, collections.abc.MutableMapping[str, Any]]:
        msg, kwargs = super().process(msg, kwargs)
        return f"{self.resource_name}: {msg}", kwargs


def _log(resource: ResourceConfig) -> logging.LoggerAdapter[logging.Logger]:
    """The log for one resource: its messages begin with the resource's name (_ResourceLog)."""
    return _ResourceLog(resource.name)


def _devices(count: int) -> str:
    """ "1 device", "2 devices": a count as a user reads it."""
    return f"{count} device" if count == 1 else f"{count} devices"


########################################################################################################
# 1. The kubelet contract
#
# Rules for this section: data only. Everything here is fixed by the kubelet (package
# k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1 and pkg/kubelet/cm/devicemanager); nothing is ours.
########################################################################################################

#: The only API version the kubelet accepts in RegisterRequest.version.
API_VERSION = "v1beta1"

#: Where the kubelet looks for plugin sockets unless it was started with another root directory
#: (k3s and RKE2 use it too; microk8s and k0s do not, see docs/deployment.md).
DEFAULT_DEVICE_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"

#: Where kubelets of the usual distributions keep it: Kubernetes (and k3s, RKE2), microk8s, k0s.
KNOWN_DEVICE_PLUGIN_DIRS = (
    DEFAULT_DEVICE_PLUGIN_DIR,
    "/var/snap/microk8s/common/var/lib/kubelet/device-plugins",
    "/var/lib/k0s/kubelet/device-plugins",
)

#: The kubelet's Registration socket, inside the device-plugin directory.
KUBELET_SOCKET = "kubelet.sock"

#: Device.health values. The kubelet counts "Healthy" as allocatable and anything else as not.
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"

#: The largest message the kubelet accepts: grpc-go's default receive limit, which it keeps. A
#: ListAndWatch list is one message, so this bounds the devices of a resource (docs/performance.md).
KUBELET_MAX_MESSAGE = 4 * 1024 * 1024

#: How long the kubelet waits for PreStartContainer (KubeletPreStartContainerRPCTimeoutInSecs).
KUBELET_PRE_START_TIMEOUT = 30.0

# The messages of v1beta1, as (message name, fields); a field is (name, number, type). A type is a
# scalar ("string", "bool", "int32", "int64"), another message of this package, "repeated T", or
# "map<string, string>". The order is gopherplug.proto's, so that the descriptor built from this
# table is byte-for-byte the one protoc makes from that file (the test suite checks it).
_MESSAGES: dict[str, tuple[tuple[str, int, str], ...]] = {
    "Empty": (),
    "DevicePluginOptions": (("pre_start_required", 1, "bool"), ("get_preferred_allocation_available", 2, "bool")),
    "RegisterRequest": (
        ("version", 1, "string"),
        ("endpoint", 2, "string"),
        ("resource_name", 3, "string"),
        ("options", 4, "DevicePluginOptions"),
    ),
    "ListAndWatchResponse": (("devices", 1, "repeated Device"),),
    "Device": (("ID", 1, "string"), ("health", 2, "string"), ("topology", 3, "TopologyInfo")),
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
    "Mount": (("container_path", 1, "string"), ("host_path", 2, "string"), ("read_only", 3, "bool")),
    "DeviceSpec": (("container_path", 1, "string"), ("host_path", 2, "string"), ("permissions", 3, "string")),
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
    "bytes": descriptor_pb2.FieldDescriptorProto.TYPE_BYTES,
    "bool": descriptor_pb2.FieldDescriptorProto.TYPE_BOOL,
    "int32": descriptor_pb2.FieldDescriptorProto.TYPE_INT32,
    "int64": descriptor_pb2.FieldDescriptorProto.TYPE_INT64,
    "uint64": descriptor_pb2.FieldDescriptorProto.TYPE_UINT64,
    "double": descriptor_pb2.FieldDescriptorProto.TYPE_DOUBLE,
}


def _json_name(field_name: str) -> str:
    """protoc's JSON name: underscores dropped, the letter after each one upper-cased."""
    head, *rest = field_name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def _add_field(
    message: Any, name: str, number: int, type_: str, package: str = API_VERSION, enums: Iterable[str] = ()
) -> None:
    """Append one field, described as in _MESSAGES, to a DescriptorProto of ``package`` (whose enum
    types are named in ``enums``)."""
    fdp = descriptor_pb2.FieldDescriptorProto
    field = message.field.add(name=name, number=number, json_name=_json_name(name))
    field.label = fdp.LABEL_OPTIONAL
    if type_.startswith("map<"):
        # A map is a repeated nested "<Name>Entry" message with key = 1, value = 2 and the
        # map_entry option: that is what protoc generates, and what the wire carries.
        key_type, value_type = (part.strip() for part in type_[4:-1].split(","))
        entry = message.nested_type.add(name=_json_name(name)[:1].upper() + _json_name(name)[1:] + "Entry")
        _add_field(entry, "key", 1, key_type, package)
        _add_field(entry, "value", 2, value_type, package)
        entry.options.map_entry = True
        field.label = fdp.LABEL_REPEATED
        field.type = fdp.TYPE_MESSAGE
        field.type_name = f".{package}.{message.name}.{entry.name}"
        return
    if type_.startswith("repeated "):
        field.label = fdp.LABEL_REPEATED
        type_ = type_.removeprefix("repeated ")
    if type_.startswith("optional "):
        # proto3 `optional`: protoc wraps the field in a synthetic oneof named "_<field>", so that
        # an empty value and no value are told apart.
        field.proto3_optional = True
        field.oneof_index = len(message.oneof_decl)
        message.oneof_decl.add(name=f"_{name}")
        type_ = type_.removeprefix("optional ")
    if type_ in _SCALARS:
        field.type = _SCALARS[type_]
    else:
        field.type = fdp.TYPE_ENUM if type_ in enums else fdp.TYPE_MESSAGE
        field.type_name = f".{package}.{type_}"


def _file_descriptor(
    name: str = "gopherplug.proto",
    package: str = API_VERSION,
    messages: Mapping[str, tuple[tuple[str, int, str], ...]] = _MESSAGES,
    services: Mapping[str, tuple[tuple[str, str, str, bool], ...]] = _SERVICES,
    enums: Mapping[str, tuple[str, ...]] | None = None,
) -> descriptor_pb2.FileDescriptorProto:
    """Build a .proto file's descriptor from tables like the ones above, as protoc would. ``enums``:
    enum name -> its value names, numbered from 0."""
    file = descriptor_pb2.FileDescriptorProto(name=name, package=package, syntax="proto3")
    for message_name, fields in messages.items():
        message = file.message_type.add(name=message_name)
        for field_name, number, type_ in fields:
            _add_field(message, field_name, number, type_, package, enums or {})
    for enum_name, values in (enums or {}).items():
        enum = file.enum_type.add(name=enum_name)
        for number, value in enumerate(values):
            enum.value.add(name=value, number=number)
    for service_name, methods in services.items():
        service = file.service.add(name=service_name)
        for method_name, request, response, server_streaming in methods:
            method = service.method.add(
                name=method_name, input_type=f".{package}.{request}", output_type=f".{package}.{response}"
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


def _message_class(name: str, package: str = API_VERSION) -> Any:
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"{package}.{name}"))


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


def _methods(
    package: str, services: Mapping[str, tuple[tuple[str, str, str, bool], ...]], messages: str | None = None
) -> dict[str, Method]:
    """Each RPC of ``services`` by its path, with the message classes of package ``messages``
    (default: ``package``). DRAPlugin's v1beta1 paths take DRA v1's classes: the kubelet's
    v1beta1 messages are the same on the wire, only its service path differs."""
    messages = messages or package
    return {
        method.path: method
        for service_name, methods in services.items()
        for method in (
            Method(f"{package}.{service_name}", name, _message_class(req, messages), _message_class(resp, messages), s)
            for name, req, resp, s in methods
        )
    }


#: Every RPC of v1beta1 by its path, e.g. METHODS["/v1beta1.Registration/Register"].
METHODS: dict[str, Method] = _methods(API_VERSION, _SERVICES)

#: The path of the one call a plugin makes to the kubelet.
REGISTER = f"/{API_VERSION}.Registration/Register"

# Not the kubelet's: gopherplug's own status service, served on each resource's socket beside
# DevicePlugin. `gopherplug probe` asks it whether the kubelet is using the resource, which no
# DevicePlugin call can tell: a plugin the kubelet never registered again answers every call.
_STATUS_FIELDS = (
    ("resource_name", 1, "string"),
    ("registered", 2, "bool"),  # Register succeeded with the kubelet that runs now
    ("streams", 3, "int32"),  # the kubelet's ListAndWatch streams open now
    ("unstreamed_seconds", 4, "double"),  # with none open: for how long, counted from the kubelet's start
    ("registration_error", 5, "string"),  # DRA: why the kubelet refused the driver, as it said
    ("unregistered_seconds", 6, "double"),  # DRA: not registered (yet): for how long, since serving
    ("dropped", 7, "string"),  # DRA: why the kubelet seems to have dropped the driver it registered
)


def _status_file_descriptor() -> descriptor_pb2.FileDescriptorProto:
    file = descriptor_pb2.FileDescriptorProto(
        name="gopherplug_status.proto", package="gopherplug", syntax="proto3", dependency=["gopherplug.proto"]
    )
    message = file.message_type.add(name="ResourceStatus")
    for field_name, number, type_ in _STATUS_FIELDS:
        _add_field(message, field_name, number, type_)
    service = file.service.add(name="Status")
    service.method.add(name="Get", input_type=f".{API_VERSION}.Empty", output_type=".gopherplug.ResourceStatus")
    return file


_POOL.Add(_status_file_descriptor())

#: gopherplug's status message, and the one call of its status service.
ResourceStatus = message_factory.GetMessageClass(_POOL.FindMessageTypeByName("gopherplug.ResourceStatus"))
GET_STATUS = Method("gopherplug.Status", "Get", v1beta1.Empty, ResourceStatus, False)

# Dynamic Resource Allocation (DRA) speaks two more APIs with the kubelet, both gRPC on unix sockets
# the plugin serves, neither through kubelet.sock:
#
# - pluginregistration (k8s.io/kubelet/pkg/apis/pluginregistration/v1, proto package
#   "pluginregistration"): the kubelet's plugin watcher finds a socket in <kubelet root>/plugins_registry,
#   calls GetInfo on it, and learns the plugin's type, name and the endpoint it really serves on;
#   then it reports back with NotifyRegistrationStatus. pluginregistration.proto in this repository.
# - DRAPlugin (k8s.io/kubelet/pkg/apis/dra/v1, proto package "k8s.io.kubelet.pkg.apis.dra.v1"; the
#   same messages in ".v1beta1", which 1.34 kubelets also know): NodePrepareResources before a pod's
#   containers start, NodeUnprepareResources after they are gone. dra.proto in this repository.
#
# DRA needs Kubernetes 1.34 or later: resource.k8s.io/v1 (GA in 1.34) is the only version KubeApi speaks.
#
# The version names a plugin lists in PluginInfo.supported_versions are not gRPC paths: "v1.DRAPlugin"
# (DRAPluginService in dra/v1/types.go) stands for the service at /k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/.

#: PluginInfo.type of a DRA driver (DRAPlugin in k8s.io/kubelet/pkg/apis/pluginregistration/v1/constants.go).
DRA_PLUGIN_TYPE = "DRAPlugin"

_REGISTRATION_PACKAGE = "pluginregistration"
_REGISTRATION_MESSAGES: dict[str, tuple[tuple[str, int, str], ...]] = {
    "PluginInfo": (
        ("type", 1, "string"),
        ("name", 2, "string"),
        ("endpoint", 3, "string"),
        ("supported_versions", 4, "repeated string"),
    ),
    "RegistrationStatus": (("plugin_registered", 1, "bool"), ("error", 2, "string")),
    "RegistrationStatusResponse": (),
    "InfoRequest": (),
}
_REGISTRATION_SERVICES = {
    "Registration": (
        ("GetInfo", "InfoRequest", "PluginInfo", False),
        ("NotifyRegistrationStatus", "RegistrationStatus", "RegistrationStatusResponse", False),
    ),
}

_DRA_MESSAGES: dict[str, tuple[tuple[str, int, str], ...]] = {
    "NodePrepareResourcesRequest": (("claims", 1, "repeated Claim"),),
    "NodePrepareResourcesResponse": (("claims", 1, "map<string, NodePrepareResourceResponse>"),),
    "NodePrepareResourceResponse": (("devices", 1, "repeated Device"), ("error", 2, "string")),
    "Device": (
        ("request_names", 1, "repeated string"),
        ("pool_name", 2, "string"),
        ("device_name", 3, "string"),
        ("cdi_device_ids", 4, "repeated string"),
        # Which share of the device (KEP-5075, consumable capacity): the allocation result's
        # shareID. In v1 since Kubernetes 1.35 (k8s.io/kubelet pkg/apis/dra/v1/api.proto); a
        # v1beta1 kubelet, which has no field 5, skips it as protobuf skips unknown fields.
        ("share_id", 5, "optional string"),
    ),
    "NodeUnprepareResourcesRequest": (("claims", 1, "repeated Claim"),),
    "NodeUnprepareResourcesResponse": (("claims", 1, "map<string, NodeUnprepareResourceResponse>"),),
    "NodeUnprepareResourceResponse": (("error", 1, "string"),),
    "Claim": (("namespace", 1, "string"), ("uid", 2, "string"), ("name", 3, "string")),
}
_DRA_SERVICES = {
    "DRAPlugin": (
        ("NodePrepareResources", "NodePrepareResourcesRequest", "NodePrepareResourcesResponse", False),
        ("NodeUnprepareResources", "NodeUnprepareResourcesRequest", "NodeUnprepareResourcesResponse", False),
    ),
}

#: The DRA API versions gopherplug serves, newest first: (name in supported_versions, proto package).
DRA_VERSIONS = (
    ("v1.DRAPlugin", "k8s.io.kubelet.pkg.apis.dra.v1"),
    ("v1beta1.DRAPlugin", "k8s.io.kubelet.pkg.apis.dra.v1beta1"),
)

# Per-device health (k8s.io/kubelet/pkg/apis/dra-health/v1alpha1/api.proto): a stream the kubelet
# opens to the DRA socket when its ResourceHealthStatus feature gate is on (alpha in 1.34, on by
# default from 1.36), to show each device's health in the pod status of the pods using it.
_DRA_HEALTH_PACKAGE = "v1alpha1"
_DRA_HEALTH_ENUMS = {"HealthStatus": ("UNKNOWN", "HEALTHY", "UNHEALTHY")}
_DRA_HEALTH_MESSAGES: dict[str, tuple[tuple[str, int, str], ...]] = {
    "NodeWatchResourcesRequest": (),
    "DeviceIdentifier": (("pool_name", 1, "string"), ("device_name", 2, "string")),
    "DeviceHealth": (
        ("device", 1, "DeviceIdentifier"),
        ("health", 2, "HealthStatus"),
        ("last_updated_time", 3, "int64"),
        ("health_check_timeout_seconds", 4, "int64"),
        ("message", 5, "string"),
    ),
    "NodeWatchResourcesResponse": (("devices", 1, "repeated DeviceHealth"),),
}
_DRA_HEALTH_SERVICES = {
    "DRAResourceHealth": (("NodeWatchResources", "NodeWatchResourcesRequest", "NodeWatchResourcesResponse", True),),
}

#: The health service's name in supported_versions (DRAResourceHealthService in dra-health/v1alpha1/types.go).
#: Kubelets before 1.37 ignore it and open the stream anyway; later ones open it only when it is listed.
DRA_HEALTH_VERSION = f"{_DRA_HEALTH_PACKAGE}.DRAResourceHealth"

#: Every DRAResourceHealth version served, newest first: (name in supported_versions, proto package).
#: v1.36 kubelets read only v1alpha1; the kubelet's main branch defines v1beta1 and v1 (the same
#: messages, k8s.io/kubelet/pkg/apis/dra-health) and opens the newest one a driver lists.
DRA_HEALTH_VERSIONS = (
    ("v1.DRAResourceHealth", "v1"),
    ("v1beta1.DRAResourceHealth", "v1beta1"),
    (DRA_HEALTH_VERSION, _DRA_HEALTH_PACKAGE),
)

#: pluginregistration.proto, dra.proto (v1, then v1beta1) and dra_health.proto as protoc makes them.
REGISTRATION_FILE_DESCRIPTOR = _file_descriptor(
    "pluginregistration.proto", _REGISTRATION_PACKAGE, _REGISTRATION_MESSAGES, _REGISTRATION_SERVICES
)
DRA_FILE_DESCRIPTORS = tuple(
    _file_descriptor(
        "dra.proto" if i == 0 else f"dra_{package.rpartition('.')[2]}.proto", package, _DRA_MESSAGES, _DRA_SERVICES
    )
    for i, (_, package) in enumerate(DRA_VERSIONS)
)
# dra_health.proto in each package (v1, v1beta1, v1alpha1). Package "v1beta1" is the device-plugin
# API's too: the health file only adds names that API does not have, as in the kubelet's own
# registry, where both are linked into one binary.
DRA_HEALTH_FILE_DESCRIPTORS = tuple(
    _file_descriptor(
        "dra_health.proto" if package == _DRA_HEALTH_PACKAGE else f"dra_health_{package}.proto",
        package,
        _DRA_HEALTH_MESSAGES,
        _DRA_HEALTH_SERVICES,
        _DRA_HEALTH_ENUMS,
    )
    for _, package in DRA_HEALTH_VERSIONS
)
DRA_HEALTH_FILE_DESCRIPTOR = DRA_HEALTH_FILE_DESCRIPTORS[-1]  #: v1alpha1's, dra_health.proto
for _file in (REGISTRATION_FILE_DESCRIPTOR, *DRA_FILE_DESCRIPTORS, *DRA_HEALTH_FILE_DESCRIPTORS):
    _POOL.Add(_file)


class pluginregistration:  # noqa: N801 - named after the protobuf package
    """The plugin watcher's messages, e.g. ``pluginregistration.PluginInfo(type="DRAPlugin", ...)``."""

    PluginInfo = _message_class("PluginInfo", _REGISTRATION_PACKAGE)
    RegistrationStatus = _message_class("RegistrationStatus", _REGISTRATION_PACKAGE)
    RegistrationStatusResponse = _message_class("RegistrationStatusResponse", _REGISTRATION_PACKAGE)
    InfoRequest = _message_class("InfoRequest", _REGISTRATION_PACKAGE)


class drapb:  # noqa: N801 - named as the kubelet's Go code imports k8s.io/kubelet/pkg/apis/dra/v1
    """The DRAPlugin messages of dra/v1 (v1beta1's are the same on the wire), e.g.
    ``drapb.NodePrepareResourcesResponse(claims={uid: ...})``."""

    _package = DRA_VERSIONS[0][1]
    NodePrepareResourcesRequest = _message_class("NodePrepareResourcesRequest", _package)
    NodePrepareResourcesResponse = _message_class("NodePrepareResourcesResponse", _package)
    NodePrepareResourceResponse = _message_class("NodePrepareResourceResponse", _package)
    Device = _message_class("Device", _package)
    NodeUnprepareResourcesRequest = _message_class("NodeUnprepareResourcesRequest", _package)
    NodeUnprepareResourcesResponse = _message_class("NodeUnprepareResourcesResponse", _package)
    NodeUnprepareResourceResponse = _message_class("NodeUnprepareResourceResponse", _package)
    Claim = _message_class("Claim", _package)


class drahealth:  # noqa: N801 - named after k8s.io/kubelet/pkg/apis/dra-health
    """The DRAResourceHealth messages, e.g. ``drahealth.DeviceHealth(health=drahealth.HEALTHY, ...)``."""

    NodeWatchResourcesRequest = _message_class("NodeWatchResourcesRequest", _DRA_HEALTH_PACKAGE)
    DeviceIdentifier = _message_class("DeviceIdentifier", _DRA_HEALTH_PACKAGE)
    DeviceHealth = _message_class("DeviceHealth", _DRA_HEALTH_PACKAGE)
    NodeWatchResourcesResponse = _message_class("NodeWatchResourcesResponse", _DRA_HEALTH_PACKAGE)
    NAMES = _DRA_HEALTH_ENUMS["HealthStatus"]  #: a HealthStatus value's name, by its number
    UNKNOWN, HEALTHY, UNHEALTHY = range(len(NAMES))


#: The RPCs of the plugin watcher (the plugin serves them), of DRAPlugin in each version, and of
#: DRAResourceHealth in each version (all with v1alpha1's classes: drahealth).
DRA_METHODS: dict[str, Method] = {
    **_methods(_REGISTRATION_PACKAGE, _REGISTRATION_SERVICES),
    **{
        path: m
        for _, package in DRA_VERSIONS
        for path, m in _methods(package, _DRA_SERVICES, DRA_VERSIONS[0][1]).items()
    },
    **{
        path: m
        for _, package in DRA_HEALTH_VERSIONS
        for path, m in _methods(package, _DRA_HEALTH_SERVICES, _DRA_HEALTH_PACKAGE).items()
    },
}
GET_INFO = "/pluginregistration.Registration/GetInfo"
NOTIFY_REGISTRATION_STATUS = "/pluginregistration.Registration/NotifyRegistrationStatus"
NODE_WATCH_RESOURCES = f"/{DRA_HEALTH_VERSION}/NodeWatchResources"

# The kubelet's PodResources API (k8s.io/kubelet/pkg/apis/podresources/v1/api.proto): who holds
# which device, from the kubelet's own books. gopherplug does not serve it; `gopherplug who` reads it.
_PODRESOURCES_PACKAGE = "v1"
_PODRESOURCES_MESSAGES: dict[str, tuple[tuple[str, int, str], ...]] = {
    "AllocatableResourcesRequest": (),
    "AllocatableResourcesResponse": (
        ("devices", 1, "repeated ContainerDevices"),
        ("cpu_ids", 2, "repeated int64"),
        ("memory", 3, "repeated ContainerMemory"),
    ),
    "ListPodResourcesRequest": (),
    "ListPodResourcesResponse": (("pod_resources", 1, "repeated PodResources"),),
    "PodResources": (
        ("name", 1, "string"),
        ("namespace", 2, "string"),
        ("containers", 3, "repeated ContainerResources"),
    ),
    "ContainerResources": (
        ("name", 1, "string"),
        ("devices", 2, "repeated ContainerDevices"),
        ("cpu_ids", 3, "repeated int64"),
        ("memory", 4, "repeated ContainerMemory"),
        ("dynamic_resources", 5, "repeated DynamicResource"),
    ),
    "ContainerMemory": (("memory_type", 1, "string"), ("size", 2, "uint64"), ("topology", 3, "TopologyInfo")),
    "ContainerDevices": (
        ("resource_name", 1, "string"),
        ("device_ids", 2, "repeated string"),
        ("topology", 3, "TopologyInfo"),
    ),
    "TopologyInfo": (("nodes", 1, "repeated NUMANode"),),
    "NUMANode": (("ID", 1, "int64"),),
    "DynamicResource": (
        ("claim_name", 2, "string"),  # 1 was class_name, removed in Kubernetes 1.31
        ("claim_namespace", 3, "string"),
        ("claim_resources", 4, "repeated ClaimResource"),
    ),
    "ClaimResource": (
        ("cdi_devices", 1, "repeated CDIDevice"),
        ("driver_name", 2, "string"),
        ("pool_name", 3, "string"),
        ("device_name", 4, "string"),
        ("share_id", 5, "optional string"),
    ),
    "CDIDevice": (("name", 1, "string"),),
    "GetPodResourcesRequest": (("pod_name", 1, "string"), ("pod_namespace", 2, "string")),
    "GetPodResourcesResponse": (("pod_resources", 1, "PodResources"),),
}
_PODRESOURCES_SERVICES = {
    "PodResourcesLister": (
        ("List", "ListPodResourcesRequest", "ListPodResourcesResponse", False),
        ("GetAllocatableResources", "AllocatableResourcesRequest", "AllocatableResourcesResponse", False),
        ("Get", "GetPodResourcesRequest", "GetPodResourcesResponse", False),
    ),
}
#: podresources.proto as protoc makes it. Package "v1" is the DRA health API's v1 too: no name is in both.
PODRESOURCES_FILE_DESCRIPTOR = _file_descriptor(
    "podresources.proto", _PODRESOURCES_PACKAGE, _PODRESOURCES_MESSAGES, _PODRESOURCES_SERVICES
)
_POOL.Add(PODRESOURCES_FILE_DESCRIPTOR)


class podresourcespb:  # noqa: N801 - named as the kubelet's Go code imports k8s.io/kubelet/pkg/apis/podresources/v1
    """The PodResources messages, e.g. ``podresourcespb.ListPodResourcesResponse(pod_resources=[...])``."""

    ListPodResourcesRequest = _message_class("ListPodResourcesRequest", _PODRESOURCES_PACKAGE)
    ListPodResourcesResponse = _message_class("ListPodResourcesResponse", _PODRESOURCES_PACKAGE)
    PodResources = _message_class("PodResources", _PODRESOURCES_PACKAGE)
    ContainerResources = _message_class("ContainerResources", _PODRESOURCES_PACKAGE)
    ContainerDevices = _message_class("ContainerDevices", _PODRESOURCES_PACKAGE)
    DynamicResource = _message_class("DynamicResource", _PODRESOURCES_PACKAGE)
    ClaimResource = _message_class("ClaimResource", _PODRESOURCES_PACKAGE)
    CDIDevice = _message_class("CDIDevice", _PODRESOURCES_PACKAGE)
    AllocatableResourcesRequest = _message_class("AllocatableResourcesRequest", _PODRESOURCES_PACKAGE)
    AllocatableResourcesResponse = _message_class("AllocatableResourcesResponse", _PODRESOURCES_PACKAGE)
    GetPodResourcesRequest = _message_class("GetPodResourcesRequest", _PODRESOURCES_PACKAGE)
    GetPodResourcesResponse = _message_class("GetPodResourcesResponse", _PODRESOURCES_PACKAGE)


#: The PodResourcesLister RPCs by path, e.g. PODRESOURCES_METHODS[LIST_POD_RESOURCES].
PODRESOURCES_METHODS: dict[str, Method] = _methods(_PODRESOURCES_PACKAGE, _PODRESOURCES_SERVICES)
LIST_POD_RESOURCES = "/v1.PodResourcesLister/List"
#: The kubelet's PodResources socket, under its root directory (podresources.Socket + ".sock" in
#: kubernetes/kubernetes pkg/kubelet/apis/podresources/constants.go; the directory is the
#: kubelet's pod-resources/).
POD_RESOURCES_SOCKET = os.path.join("pod-resources", "kubelet.sock")

#: The longest path a unix socket can be bound or connected at.
MAX_SOCKET_PATH = 107


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
    Raised by a handler, it becomes the call's status on the wire instead of a generic error."""

    def __init__(self, code: StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class RestartNeeded(GopherplugError):  # noqa: N818 - it says what the error asks for
    """What only a new process can fix (the kubelet's directory deleted under a pod's mount): it ends
    serve, where every other failure of a running task is supervised (_supervised)."""


class NotYet(GopherplugError):  # noqa: N818 - it says what the error asks for
    """What the node refuses for now (a reload's CDI spec on a full disk): its task says why and is started
    again (_supervised, silent), not counted by /healthz: a new pod would meet the same disk."""


class ConfigError(GopherplugError):
    """The configuration is wrong: says which file, which key, and what to fix, in one line.

    ``str(error)`` reads like ``gopherplug.yaml: resources[0].directory: must be an absolute path``."""

    def __init__(self, source: str, key_path: str, problem: str) -> None:
        key_path = key_path.lstrip(".")  # a key of a resource given on its own, not in a list
        if not key_path.isprintable():  # a key with a newline in it: still one line
            key_path = repr(key_path)[1:-1]
        super().__init__(f"{source}: {key_path}: {problem}" if key_path else f"{source}: {problem}")
        self.source = source
        self.key_path = key_path
        self.problem = problem


class ClaimError(GopherplugError):
    """A ResourceClaim cannot be prepared on this node: one line, sent to the kubelet as the claim's error."""


class DescribeError(GopherplugError):
    """A resource's ``describe`` failed: its one line says how, with its stderr's first and last lines."""


class ApiError(GopherplugError):
    """A request to the API server failed: ``status`` is the HTTP status, or None when no answer came;
    ``retry_after`` the seconds its Retry-After header asked for (a 429, a 503), if any; ``causes``
    the reasons of the answer's details.causes ("ResourceVersionTooLarge", "FieldValueInvalid")."""

    def __init__(
        self, status: int | None, message: str, retry_after: float | None = None, causes: tuple[str, ...] = ()
    ) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after
        self.causes = causes


class ExecCredentialError(ApiError):
    """An exec credential plugin did not give a credential: KubeApi's requests fail with this line
    (KubeApi._errors puts what the request was for in front of it), and are retried as any request
    the API server did not answer (status None)."""

    def __init__(self, message: str) -> None:
        super().__init__(None, message)


class WatchEventError(ApiError):
    """A watch brought a line that is not an event: something between the API server and here mangled
    the stream. list_and_watch says so in one line and lists again."""

    def __init__(self, message: str) -> None:
        super().__init__(None, message)


class UnexpectedAdmissionError(GopherplugError):
    """A pod the simulated kubelet rejects while admitting it, as the real one does with the pod
    status reason UnexpectedAdmissionError: the kubelet itself refused, the plugin was never asked."""


########################################################################################################
# 3. Model
#
# Rules for this section: frozen dataclasses, no I/O. A Config is only ever built by parse_config,
# so every instance is valid.
########################################################################################################


#: Between a device ID and its replica number in the IDs the kubelet sees ("gopher0::1").
REPLICA_SEPARATOR = "::"


@functools.cache
def _replica_numbers(replicas: int) -> frozenset[str]:
    """The replica numbers as replica IDs spell them: "0" to "<replicas-1>", no sign, no leading zero.
    (A set lookup, not int(): int() fails on "²", which isdigit() accepts.)"""
    return frozenset(map(str, range(replicas)))


@dataclass(frozen=True)
class DeviceSpecTemplate:
    """One ``device_specs`` entry: a DeviceSpec per allocated entry, {id} {path} {name} {target} {index} filled in.

    In a scanned entry of a resource with ``cdi``, also the host file's mode and owner, as the last
    look found them (None: no cdi, or no stat). A CDI spec needs them (without them, the runtime
    makes the node 0666 root:root); in the entry, a chmod or chown writes the spec again. (One
    field, not three: a scan of 50,000 nodes makes 50,000 instances.)"""

    host_path: str
    container_path: str
    permissions: str = "rw"
    host_mode: tuple[int, int, int] | None = None  #: the host file's mode without its type bits, uid, gid


@dataclass(frozen=True)
class MountTemplate:
    """One ``mounts`` entry: a Mount per allocated entry, {id} {path} {name} {target} {index} filled in."""

    host_path: str
    container_path: str
    read_only: bool = True


@dataclass(frozen=True)
class CDIConfig:
    """``cdi``: name devices to the container runtime as CDI devices, described in a spec file."""

    kind: str  #: "vendor.com/class"; a device is then "vendor.com/class=<id>"
    spec_dir: str = "/var/run/cdi"  #: where the runtime reads CDI specs (/etc/cdi is the other usual one)

    @property
    def spec_file(self) -> str:
        """The spec file gopherplug owns: "<vendor>-<class>.json", the CDI tools' naming."""
        return os.path.join(self.spec_dir, self.kind.replace("/", "-") + ".json")

    @property
    def lock_file(self) -> str:
        """What write_cdi_spec flocks: ".<vendor>-<class>.json.lock", one per kind, for the
        resource's spec and its claims' (runtimes read only .json and .yaml files there)."""
        return os.path.join(self.spec_dir, f".{self.kind.replace('/', '-')[:200]}.json.lock")


@dataclass(frozen=True)
class ClaimCDISpec(CDIConfig):
    """The CDI spec file of one prepared claim's own CDI devices (claim_cdi_specs), beside the
    resource's spec: "<vendor>-<class>_<claim UID>.json". One per claim, written at prepare and
    removed at unprepare, so that claims prepared at once never rewrite each other's devices."""

    claim_uid: str = ""

    @property
    def spec_file(self) -> str:
        # The kind is cut so that the name stays within 255 bytes.
        return os.path.join(self.spec_dir, f"{self.kind.replace('/', '-')[:200]}_{self.claim_uid}.json")


#: Where the kubelet keeps its state unless started with --root-dir: plugins_registry/ and plugins/
#: are in it (k3s and RKE2 use it too; microk8s: /var/snap/microk8s/common/var/lib/kubelet).
DEFAULT_KUBELET_DIR = "/var/lib/kubelet"


@dataclass(frozen=True)
class DraConfig:
    """``dra``: also be a Dynamic Resource Allocation driver, for the resources whose ``api`` says so."""

    driver: str  #: the driver's name, a DNS subdomain: ResourceSlices and DeviceClasses name it
    kubelet_dir: str = DEFAULT_KUBELET_DIR  #: the kubelet's root directory
    #: the effect of an unhealthy device's taint in its ResourceSlice: NoSchedule, or NoExecute to evict
    unhealthy_taint: str = "NoSchedule"
    #: this pod's UID (POD_UID, from the downward API), "" if not known: the sockets carry it, so that
    #: two pods of the DaemonSet can serve side by side during a rolling update
    pod_uid: str = ""
    #: write each prepared claim's device metadata file and mount it into its containers (KEP-5304;
    #: device_metadata_files): on unless ``dra: {device_metadata: false}``
    device_metadata: bool = True

    @property
    def registration_socket(self) -> str:
        """Where the kubelet's plugin watcher finds the driver: a socket in plugins_registry,
        "<driver>-reg.sock", or with a pod UID the first of these names that fits in a unix socket's
        path (the Go helper's RollingUpdate option's, kubernetes/dynamic-resource-allocation
        kubeletplugin/draplugin.go). The watcher registers every socket there, whatever its name."""
        registry = os.path.join(self.kubelet_dir, "plugins_registry")
        if not self.pod_uid:
            return os.path.join(registry, f"{self.driver}-reg.sock")
        uid_hash = _url_safe_digest(self.pod_uid, 8)
        both_hash = _url_safe_digest(f"{self.driver}\0{self.pod_uid}", 16)
        names = (f"{self.driver}-{self.pod_uid}", f"{self.driver}-{uid_hash}", f"dra-{both_hash}")
        paths = [os.path.join(registry, f"{name}-reg.sock") for name in names]
        return next((path for path in paths if len(path) <= MAX_SOCKET_PATH), paths[-1])

    @property
    def plugin_dir(self) -> str:
        """The driver's own directory: the DRAPlugin socket and the checkpoint of prepared claims."""
        return os.path.join(self.kubelet_dir, "plugins", self.driver)

    @property
    def endpoint(self) -> str:
        """The socket serving DRAPlugin, as GetInfo tells the kubelet: "dra.sock", or with a pod UID
        "dra-<pod UID>.sock" (the Go helper's name), "dra-<hash of the UID>.sock" where that is too
        long for a unix socket (the kubelet dials whatever GetInfo names)."""
        if not self.pod_uid:
            return os.path.join(self.plugin_dir, "dra.sock")
        path = os.path.join(self.plugin_dir, f"dra-{self.pod_uid}.sock")
        hashed = os.path.join(self.plugin_dir, f"dra-{_url_safe_digest(self.pod_uid, 8)}.sock")
        return path if len(path) <= MAX_SOCKET_PATH else hashed

    @property
    def checkpoint(self) -> str:
        """The prepared claims, kept across restarts of the plugin; both pods of a rolling update share it."""
        return os.path.join(self.plugin_dir, "checkpoint.json")

    @property
    def metadata_dir(self) -> str:
        """Where the device metadata files of prepared claims are kept on the host, to be bind-mounted
        into containers: where the Go helper keeps them (metadataSubDir in
        kubernetes/dynamic-resource-allocation kubeletplugin/metadata.go)."""
        return os.path.join(self.plugin_dir, "dra-device-metadata")

    @property
    def serialize_lock(self) -> str:
        """The flock every pod of the driver takes around a change of the checkpoint (the Go helper's
        "serialize.lock", in the same directory)."""
        return os.path.join(self.plugin_dir, "serialize.lock")


def _url_safe_digest(text: str, length: int) -> str:
    """The first ``length`` bytes of text's SHA-256, in unpadded URL-safe base64 (a file name)."""
    return base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()[:length]).decode().rstrip("=")


#: The environment variable that gives a DRA driver its pod's UID (downward API: metadata.uid).
POD_UID_ENV = "POD_UID"
#: What a pod UID may be here: the API server makes UUIDs; anything that is one path component.
_POD_UID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")


#: A resource's ``api``: which of the kubelet's APIs offers its devices on this node. One, never both:
#: the two would each give the same device to a pod, neither knowing what the other gave (a cluster
#: moves a resource node by node: docs/dra.md, "Moving a resource from the device plugin to DRA").
APIS = ("device-plugin", "dra")

#: What a file that still says ``api: both`` or ``allow_double_booking`` is told to do instead.
_ONE_API = (
    "a node serves a resource through one API: api: device-plugin or api: dra, with the DRA DeviceClass's "
    "extendedResourceName for pods that ask for it in resources.limits (docs/dra.md: Moving a resource from the "
    "device plugin to DRA)"
)


@dataclass(frozen=True)
class Source:
    """One ``match`` entry: the entries of ``directory`` whose names fit ``pattern``."""

    directory: str  #: absolute
    pattern: str = "*"  #: fnmatch glob on entry names; hidden entries never match


@dataclass(frozen=True)
class UsbSelector:
    """One ``usb`` entry: which USB devices to find, by vendor and product as lsusb prints them,
    and by serial if given."""

    vendor: str  #: 4 hex digits, lower case ("1050")
    product: str  #: 4 hex digits, lower case ("0407")
    serial: str | None = None  #: None: any serial, or none at all


#: The types an attribute's value may have: the fields of a DeviceAttribute (k8s.io/api resource/v1),
#: exactly one of which the API server takes in each attribute
ATTRIBUTE_TYPES = ("string", "int", "bool", "version")


@dataclass(frozen=True)
class DeclaredValue:
    """One entry of a resource's ``attributes`` or ``capacity``: a literal, the same for every
    device, or a file read when each device is examined (``file``, a path template)."""

    name: str  #: as written: "model" (in the DRA driver's domain) or "example.com/model" (in its own)
    type: str  #: one of ATTRIBUTE_TYPES for an attribute; "quantity" for a capacity
    #: the literal, valid (a quantity in its canonical form, as the API server stores it); None: read from ``file``
    value: str | int | bool | None = None
    #: the file's path template ({id}, {path}, {name}, {target}, {sysfs}); "" for a literal
    file: str = ""


@dataclass(frozen=True)
class ResourceConfig:
    """One extended resource: where its devices come from and what a container gets for them.

    Devices come from directory entries (``directory`` and ``pattern``, or several ``match``
    sources) and from USB devices (``usb``). An entry's ID is its name, or what ``id_pattern``
    takes from it; entries with the same ID are one device, made of all of them."""

    name: str  #: the extended resource name, e.g. "example.com/gopher"
    directory: str  #: absolute; every matching entry is a device ("" when ``match`` or ``usb`` say it)
    pattern: str = "*"  #: fnmatch glob on entry names; hidden entries never match
    env: str = ""  #: env var given the allocated IDs, comma-joined ("" only before parse_config fills it)
    device_specs: tuple[DeviceSpecTemplate, ...] | None = None  #: None: device nodes pass through as they are
    mounts: tuple[MountTemplate, ...] = ()
    annotations: tuple[tuple[str, str], ...] = ()  #: (key template, value template) pairs
    replicas: int = 1  #: each device is offered this many times, as "<id>::<n>" when more than 1
    preferred: str = "packed"  #: GetPreferredAllocation: "packed" (replicas of one device together) or "spread"
    cdi: CDIConfig | None = None
    pre_start: tuple[str, ...] = ()  #: argv run before each container start (DRA: claim prepared); empty: none
    pre_start_timeout: float = 25.0  #: seconds; the kubelet gives PreStartContainer 30
    allowed_host_paths: tuple[str, ...] = ()  #: roots besides `directory` and /dev that host paths may use
    match: tuple[Source, ...] = ()  #: the sources, when more than ``directory`` and ``pattern``
    id_pattern: re.Pattern[str] | None = None  #: its group "id", from the whole name, is the entry's ID
    usb: tuple[UsbSelector, ...] = ()  #: USB devices that are devices of this resource
    api: str = "device-plugin"  #: one of APIS: the device-plugin API or DRA
    allow_mounted: bool = False  #: offer a block device that holds a mounted filesystem (else skipped)
    #: other resources of the configuration that may offer the same device nodes as this one (shared_nodes)
    shared_with: tuple[str, ...] = ()
    #: attributes each device carries (DeclaredValue): in its ResourceSlice entry, and for NFD
    attributes: tuple[DeclaredValue, ...] = ()
    #: capacity each device has (DeclaredValue, of type "quantity"): in its ResourceSlice entry
    capacity: tuple[DeclaredValue, ...] = ()
    #: argv run once per scan of the resource, printing attributes and capacity by device ID (run_describe)
    describe: tuple[str, ...] = ()
    driver: str = ""  #: the DRA driver: a name in its domain is one without ("<driver>/model" is "model")

    @property
    def device_plugin(self) -> bool:
        """Whether the device-plugin API offers the devices (api: device-plugin)."""
        return self.api == "device-plugin"

    @property
    def dra(self) -> bool:
        """Whether ResourceSlices offer the devices to DRA (api: dra)."""
        return self.api == "dra"

    @property
    def sources(self) -> tuple[Source, ...]:
        """The directories whose entries are devices: ``match``, or ``directory`` and ``pattern``."""
        return self.match or ((Source(self.directory, self.pattern),) if self.directory else ())

    def origin(self) -> str:
        """Where the devices come from, for messages: "/dev/ttyUSB*, /dev/ttyACM*, USB 1050:0407"."""
        places = [os.path.join(source.directory, source.pattern) for source in self.sources]
        places += [f"USB {usb.vendor}:{usb.product}" + (f" {usb.serial!r}" if usb.serial else "") for usb in self.usb]
        return ", ".join(places) or "the embedding program"  # serve_dra_devices: the program's own devices

    def replica_ids(self, device_id: str) -> list[str]:
        """The IDs the kubelet sees for one device: the ID itself, or "<id>::0" ... "<id>::<replicas-1>"."""
        if self.replicas == 1:
            return [device_id]
        return [f"{device_id}{REPLICA_SEPARATOR}{n}" for n in range(self.replicas)]

    def underlying_id(self, kubelet_id: str) -> str | None:
        """The device behind an ID the kubelet uses, or None if no replica of any device has that ID."""
        return self.underlying_ids((kubelet_id,))[0]

    def underlying_ids(self, kubelet_ids: Iterable[str]) -> list[str | None]:
        """underlying_id of each ID, in one pass: GetPreferredAllocation maps tens of thousands at once."""
        if self.replicas == 1:
            return list(kubelet_ids)
        numbers = _replica_numbers(self.replicas)
        split = (kubelet_id.rpartition(REPLICA_SEPARATOR) for kubelet_id in kubelet_ids)
        return [device_id if separator and replica in numbers else None for device_id, separator, replica in split]


@dataclass(frozen=True)
class Config:
    """A whole validated configuration file."""

    resources: tuple[ResourceConfig, ...]
    device_plugin_dir: str | None = None  #: None: found at start, see find_device_plugin_dir()
    source: str = "<config>"  #: the file it came from, for messages
    sysfs_root: str = "/sys"  #: the host's sysfs (NUMA nodes, USB devices); tests point it at a fake tree
    dev_root: str = "/dev"  #: the host's /dev: where USB devices' nodes are, and implicitly allowed host paths
    dra: DraConfig | None = None  #: the DRA driver, when a resource's api is dra
    metrics_address: str | None = None  #: "host:port" to serve Prometheus metrics on; None: no metrics
    #: likely mistakes that are valid all the same, each a line like a ConfigError's ("file: key: problem")
    warnings: tuple[str, ...] = ()
    #: "host:port" to answer the kubelet's liveness check on (GET /healthz); None: not served
    health_address: str | None = None
    #: the Node Feature Discovery feature file to keep (nfd_features): each resource's count and the
    #: attributes its devices share, as node labels; None: none
    nfd_features_file: str | None = None


@dataclass(frozen=True)
class DeviceEntry:
    """One device, and what it gives a container: a directory entry, or several made one device.

    A device of several entries (the same ID from ``id_pattern``, or a USB device's nodes) has
    each in ``members``, and the sum of theirs in its own fields: every DeviceSpec and mount,
    unhealthy while any is."""

    id: str  #: the ID the kubelet knows it by: the entry's name, or what id_pattern takes from it
    path: str  #: the entry's full path (the first member's)
    is_device_node: bool = False  #: a character or block device node (then passed through by default)
    health: str = HEALTHY
    problem: str = ""  #: why it is unhealthy, for the log and for a refused Allocate
    numa_node: int | None = None  #: from sysfs, for device nodes; None: no topology
    device_specs: tuple[DeviceSpecTemplate, ...] = ()  #: host paths filled in; container paths may hold {index}
    mounts: tuple[MountTemplate, ...] = ()  #: the same, for mounts
    followed: tuple[str, ...] = ()  #: for a symlink, every path it leads through: watched, they decide its health
    members: tuple[DeviceEntry, ...] = ()  #: the entries it is made of, when more than one
    pci: PciAddress | None = None  #: from sysfs, for a device node of a PCI device; None: not one
    usb: UsbDevice | None = None  #: the USB device it is a node of (usb entries); None: not one
    #: the device's directory in sysfs ("/sys/devices/pci0000:00/0000:03:00.0/drm/card1"), "" where
    #: none is known: the {sysfs} of ``attributes`` and ``capacity`` file templates
    sysfs: str = ""
    #: attributes read for it (from ``attributes`` files and ``describe``), valid, by name: (name, type,
    #: value) in name order. The resource's literals are not here: device_attributes adds them.
    attributes: tuple[tuple[str, str, str | int | bool], ...] = ()
    #: capacity read for it, likewise: (name, quantity in canonical form) in name order
    capacity: tuple[tuple[str, str], ...] = ()
    rdev: int = 0  #: a node's device number (st_rdev) as examined, whose numa_node and pci these are; 0: none

    def __post_init__(self) -> None:
        # The kubelet takes any string for health and counts only "Healthy" as allocatable: a
        # "Broken" or "healthy" from an embedding program would reach it as an unhealthy device
        # with no one told why. Two string compares (the scans build every entry through here).
        if self.health != HEALTHY and self.health != UNHEALTHY:
            raise ValueError(
                f"DeviceEntry {self.id!r}: health={self.health!r}: use gopherplug.HEALTHY or gopherplug.UNHEALTHY "
                "('Healthy' or 'Unhealthy', as the kubelet spells them)"
            )


@dataclass(frozen=True)
class PciAddress:
    """Where a PCI device sits: its bus ID ("0000:03:00.0", extended BDF notation) and its PCIe
    root complex ("pci0000:00"), the names sysfs gives both."""

    bus_id: str
    root: str


########################################################################################################
# 4. Pure core
#
# Rules for this section: synchronous and deterministic; inputs are arguments (a directory path,
# not a global), results are return values; no logging, no sleeping. Configuration text becomes a
# Config, a directory becomes devices, devices and a request become the kubelet's responses.
########################################################################################################
# 4a. The configuration: YAML -> Config, names, sockets, DRA's declarations ----------------------------
# The kubelet accepts an extended resource name ("domain/name") only if it is not native to
# Kubernetes and "requests.<name>" is a qualified name (k8s.io/api helper IsExtendedResourceName).
_QUALIFIED_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
# Device IDs: the kubelet wants at most 63 characters; these characters are safe in env values,
# paths, CDI names and log lines alike. ":" too (the kubelet accepts any string, and PCI addresses
# and by-path names have it: the SR-IOV plugin's IDs are PCI addresses), but not "::", which
# separates a replica's number.
_DEVICE_ID = re.compile(r"(?!.*::)[A-Za-z0-9._:-]{1,63}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# The env var is set in the container's environment and in the pre_start command's, where some
# names change how programs are found, loaded and run (PATH=g1,g2 and neither finds its programs):
# every LD_* (the dynamic loader's: LD_PRELOAD, LD_LIBRARY_PATH...), the others of glibc's
# UNSECURE_ENVVARS (what it drops for setuid programs), and the shell's own.
_LOADER_ENV = frozenset(
    "GCONV_PATH GETCONF_DIR HOSTALIASES LOCALDOMAIN LOCPATH MALLOC_TRACE NIS_PATH NLSPATH RESOLV_HOST_CONF "
    "RES_OPTIONS TMPDIR TZDIR".split()
)
_SHELL_ENV = frozenset("PATH HOME SHELL IFS ENV BASH_ENV CDPATH SHELLOPTS BASHOPTS PS4 GLOBIGNORE PWD OLDPWD".split())
# A template's placeholders: {id} the device's ID, {path} the entry's path, {name} its name (a
# member's, in a device of several), {target} the file a symlink leads to (the path itself if it is
# none), {index} the device's position in the allocation (container paths only).
_TEMPLATE_FIELDS = {"id": "gopher0", "path": "/dev/gopher0", "name": "gopher0", "target": "/dev/gopher0", "index": 0}


def resource_name_problem(name: str) -> str | None:
    """Why the kubelet would refuse ``name`` as an extended resource name, or None if it would accept it."""
    if name.count("/") != 1:
        return "must be an extended resource name, domain/name (e.g. example.com/gopher)"
    if "kubernetes.io/" in name:
        return "the kubernetes.io domain is reserved for Kubernetes' own resources"
    if name.startswith("requests."):
        return 'must not start with "requests."'
    domain, short = name.split("/")
    if not _QUALIFIED_NAME.fullmatch(short) or len(short) > 63:
        return (
            "the name after '/' must be 1 to 63 letters, digits, '-', '_' or '.', "
            "starting and ending with a letter or digit"
        )
    if not _DNS_SUBDOMAIN.fullmatch(domain) or len("requests." + domain) > 253:
        return "the domain before '/' must be a lower-case DNS subdomain (e.g. example.com)"
    return None


def default_env_name(resource_name: str) -> str:
    """The env var used when a resource sets none: "example.com/gopher" -> "GOPHER_DEVICES"."""
    short = re.sub(r"[^A-Z0-9_]", "_", resource_name.rpartition("/")[2].upper())
    return f"{'_' if short[:1].isdigit() else ''}{short}_DEVICES"


# Socket names. The kubelet's `endpoint` is a file name in its directory, and a unix socket's path
# is at most 107 bytes (sun_path holds 108, the last a NUL): microk8s' directory alone takes 56.
#: Socket numbers go round 1..SOCKET_NUMBERS: each registration needs a name other than the last
#: one's, and a bounded number keeps the longest path known when the configuration is checked.
SOCKET_NUMBERS = 9999
_SOCKET_NAME = re.compile(r"gopherplug-([^/]+)-(\d+)\.sock")


def socket_stem(resource_name: str, device_plugin_dir: str) -> str:
    """What every socket (and the lock file) of a resource is named after, in a given directory.

    "gopherplug-example.com_gopher" says whose it is; where that would make a socket path too long
    (a long resource name in a long directory), a digest of the name stands in for it."""
    readable = f"gopherplug-{resource_name.replace('/', '_')}"
    if len(os.path.join(device_plugin_dir, f"{readable}-{SOCKET_NUMBERS}.sock")) <= MAX_SOCKET_PATH:
        return readable
    return f"gopherplug-{hashlib.sha256(resource_name.encode()).hexdigest()[:16]}"


def socket_name(resource_name: str, device_plugin_dir: str, number: int) -> str:
    """The socket file for one registration: fresh per registration, never hidden."""
    return f"{socket_stem(resource_name, device_plugin_dir)}-{(number - 1) % SOCKET_NUMBERS + 1}.sock"


def parse_socket_name(name: str) -> tuple[str, int] | None:
    """(stem, number) of a socket_name(), or None for any other file name."""
    match = _SOCKET_NAME.fullmatch(name)
    return (f"gopherplug-{match[1]}", int(match[2])) if match else None


def resource_of_stem(stem: str) -> str | None:
    """The resource name a readable stem spells ("gopherplug-example.com_gopher" -> example.com/gopher),
    None for a digest. Unambiguous: a domain is a DNS name, without "_"; the name part may have one."""
    domain, separator, name = stem.removeprefix("gopherplug-").partition("_")
    return f"{domain}/{name}" if separator else None


def device_plugin_dir_problem(directory: str) -> str | None:
    """Why no socket can be served in ``directory`` (its path is too long), or None."""
    longest = len(os.path.join(directory, f"gopherplug-{'0' * 16}-{SOCKET_NUMBERS}.sock"))  # a digest stem
    if longest > MAX_SOCKET_PATH:
        room = MAX_SOCKET_PATH - (longest - len(directory))
        return (
            f"{directory!r} is {len(directory)} characters long: a socket path in it would pass the "
            f"{MAX_SOCKET_PATH} bytes unix sockets allow; use a directory of at most {room} characters"
        )
    return None


class _Octal(int):
    """An integer YAML 1.1 read as octal (010 is 8), with the text it was written as."""

    written = ""


class _ConfigLoader(yaml.SafeLoader):
    """SafeLoader, except that an integer written with a leading zero comes out as an _Octal: PyYAML
    follows YAML 1.1, where 010 is 8 and 0407 is 263, which no one writing this file means. And a key
    written twice in one mapping is refused: YAML 1.2 says keys are unique; PyYAML keeps the last."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[tuple[str, Any], yaml.Node] = {}
        for key, _ in node.value:
            if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                if (first := seen.setdefault((key.tag, key.value), key)) is not key:
                    lines = f"lines {first.start_mark.line + 1} and {key.start_mark.line + 1}"
                    raise _DuplicateKey(f"key {key.value!r} is written twice in one mapping, on {lines}: keep one")
        mapping: dict[Any, Any] = super().construct_mapping(node, deep)
        return mapping

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except (ValueError, LookupError, AttributeError):  # PyYAML's, on "!!int x", "!!int " or 2020-02-30
            said = f"{node.value!r} is not a valid {node.tag.rpartition(':')[2]}: put it in quotes if it is text"
            raise yaml.constructor.ConstructorError(None, None, said, node.start_mark) from None


class _DuplicateKey(yaml.YAMLError):
    """A key written twice in one mapping (_ConfigLoader). A merge (``<<: *base``) may set one again."""


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    value: int = loader.construct_yaml_int(node)
    if isinstance(node.value, str) and re.fullmatch(r"[-+]?0[0-7_]+", node.value):
        octal = _Octal(value)
        octal.written = node.value
        return octal
    return value


_ConfigLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)


def _octal_numbers(data: Any, where: str = "") -> Iterator[tuple[str, _Octal]]:
    """Every _Octal in the loaded data, with its key path ("resources[0].replicas")."""
    seen: set[int] = set()  # anchors and aliases can make a list that holds itself
    stack = [(where, data)]
    while stack:
        at, item = stack.pop()
        if isinstance(item, _Octal):
            yield at, item
        elif isinstance(item, dict | list) and id(item) not in seen:
            seen.add(id(item))
            pairs = item.items() if isinstance(item, dict) else enumerate(item)
            keys = [(f"{at}.{key}" if isinstance(item, dict) else f"{at}[{key}]", value) for key, value in pairs]
            stack += reversed(keys)


# PyYAML says where it stopped, in the parser's words ("expected <block end>, but found '<block
# mapping start>'"), and often a line after the mistake: a key without a space after its colon is
# read as one word with its value, and only the next line's key is found out of place. The common
# mistakes are told in a sentence of their own, at the line where they are; a fix is proposed only
# when the text parses with it (or gets past the line PyYAML stopped at).
#: What YAML takes for a line break (PyYAML's reader counts lines by these; str.splitlines by more).
_YAML_LINE_BREAK = re.compile(r"\r\n|[\r\n\x85\u2028\u2029]")
# A key written without a space after its colon: "name:example.com/gopher", "- directory:/dev".
_KEY_WITHOUT_SPACE = re.compile(r"(?:[ ]*-[ ]+)*[ ]*[^\s#'\"\[\]{}:,&*!|>%@`-][^\s:]*:(?=[^\s:])")
# A content line's indentation, and (after any "- ") where its key or value begins.
_INDENTED = re.compile(r"([ ]*)((?:-[ ]+)*)\S")


def _yaml_problem(text: str, error: yaml.YAMLError | RecursionError | ValueError) -> str:
    """A YAML syntax error as one line: where PyYAML stopped and what it said, and for a common
    mistake (a tab, a key without a space after its colon, a list item among a mapping's keys, a
    line indented unlike the lines above it) the mistake in a plain sentence first."""
    mark = getattr(error, "problem_mark", None)
    said = getattr(error, "problem", None) or str(error)
    if isinstance(error, RecursionError):
        return "invalid YAML: lists or mappings nested hundreds deep"
    if not isinstance(error, yaml.YAMLError):  # a ValueError: PyYAML's scanner, as parse_config says
        return f"invalid YAML: {'an escape past U+10FFFF' if 'chr()' in str(error) else error}"
    if isinstance(error, yaml.reader.ReaderError):  # a character YAML refuses anywhere: no mark, and 2 lines
        lines = _YAML_LINE_BREAK.split(text[: error.position])
        where = f"invalid YAML at line {len(lines)}, column {len(lines[-1]) + 1}"
        if 0xDC80 <= error.character <= 0xDCFF:  # a byte _read_text could not decode (surrogateescape)
            return f"{where}: byte 0x{error.character - 0xDC00:02x} is not UTF-8: save the file as UTF-8"
        return f"{where}: U+{error.character:04X} is not allowed"
    if mark is None:
        return f"invalid YAML ({said})"
    said = f"line {mark.line + 1}, column {mark.column + 1}: {said}"
    lines = _YAML_LINE_BREAK.split(text)
    mistake = _unquoted_star(lines, error) or _yaml_mistake(lines, error, mark.line, mark.column)
    if mistake is None:
        return f"invalid YAML ({said})"
    line, column, sentence = mistake
    return f"invalid YAML at line {line + 1}, column {column + 1}: {sentence} (PyYAML at {said})"


# A value that begins with "*" is an alias to YAML (a reference to an "&anchor"), not text: a glob
# written bare, `pattern: *` or `pattern: *.sock`, is a syntax error ("expected alphabetic or
# numeric character") and `pattern: *abc` an undefined alias.
_STAR_VALUE = re.compile(r"\*[^\s,\]}]*")
_KEY_BEFORE = re.compile(r"([^\s#'\"\[\]{}:,]+):[ ]+$")


def _unquoted_star(lines: list[str], error: Any) -> tuple[int, int, str] | None:
    """(line, column, sentence) when ``error`` is PyYAML reading a glob that begins with "*" as an
    alias, else None."""
    if "while scanning an alias" in (getattr(error, "context", None) or ""):
        mark = getattr(error, "context_mark", None)
    elif (getattr(error, "problem", None) or "").startswith("found undefined alias"):
        mark = getattr(error, "problem_mark", None)
    else:
        return None
    if mark is None or not 0 <= mark.line < len(lines):
        return None
    line = lines[mark.line]
    value = _STAR_VALUE.match(line, mark.column)
    if value is None:
        return None
    key = _KEY_BEFORE.search(line[: mark.column])
    quoted = f'{key[1]}: "{value[0]}"' if key else f'"{value[0]}"'
    read = f"{_as_written(value[0])} is read by YAML as an alias (a reference to an &anchor)"
    return mark.line, mark.column, f"{read}: put it in quotes, {quoted}"


def _yaml_mistake(lines: list[str], error: Any, at: int, column: int) -> tuple[int, int, str] | None:
    """(line, column, sentence) of a common mistake that explains ``error``, which PyYAML raised
    at line ``at`` of ``lines`` (0-based), or None."""
    problem = getattr(error, "problem", None) or ""
    if not isinstance(error, yaml.scanner.ScannerError | yaml.parser.ParserError) or not 0 <= at < len(lines):
        return None  # not a syntax error (an unknown tag, an undefined alias): PyYAML's words say it
    if "'\\t'" in problem:  # "found character '\t' that cannot start any token"
        return at, column, "a tab: YAML takes only spaces, to indent and after a key's colon: replace it with spaces"
    # The content lines above, nearest first (blank lines and comments say nothing about structure).
    above = [n for n in range(at - 1, -1, -1) if lines[n].strip() and not lines[n].lstrip().startswith("#")]
    # A key without its space is found out on its own line or at the next key, below it.
    context = getattr(error, "context_mark", None)
    suspects = [at, *above[:1], *([context.line] if context is not None and context.line < at else [])]
    for n in dict.fromkeys(suspects):
        if (glued := _KEY_WITHOUT_SPACE.match(lines[n])) is not None:
            fixed = lines[n][: glued.end()] + " " + lines[n][glued.end() :]
            if _parses_past([*lines[:n], fixed, *lines[n + 1 :]], at):
                written = fixed.strip().lstrip("- ")
                return n, glued.end() - 1, f"a key needs a space after its colon: write {written!r}"
    if problem.endswith("but found '-'") and "mapping" in (getattr(error, "context", None) or ""):
        sentence = "a list item ('- ') among the keys of a mapping (key: value): remove its '- ', or begin the "
        return at, column, sentence + "mapping's first key with '- ' too, for a list of mappings"
    if not above or not (problem.startswith("mapping values are not allowed") or "expected <block end>" in problem):
        return None
    this, over = _INDENTED.match(lines[at]), _INDENTED.match(lines[above[0]])
    if this is None or over is None or len(this[1]) == over.end() - 1:
        return None  # as far in as the key above it: the mistake is not the indentation
    spaces = len(this[1])
    sentence = f"this line is indented by {_spaces(spaces)}, unlike the lines above it"
    # The indentations of the lines above, nearest first: each line's key (after any "- "), then its
    # "- ". The first that makes the text parse is the one to propose.
    widths: dict[int, int] = {}  # indentation -> the nearest line above that has it
    for n in above:
        if (other := _INDENTED.match(lines[n])) is not None:
            widths.setdefault(other.end() - 1, n)
            widths.setdefault(len(other[1]), n)
    for width, n in itertools.islice(widths.items(), 8):
        if width != spaces and _parses_past([*lines[:at], " " * width + lines[at].lstrip(" "), *lines[at + 1 :]], at):
            key = lines[n].strip().lstrip("- ").partition(":")[0]
            return at, spaces, f"{sentence}: indent it as far as {key!r} on line {n + 1} ({_spaces(width)})"
    return at, spaces, f"{sentence}: indent a key as far as the other keys of its mapping"


def _spaces(count: int) -> str:
    """ "1 space", "4 spaces"."""
    return f"{count} space" if count == 1 else f"{count} spaces"


def _parses_past(lines: list[str], at: int) -> bool:
    """Whether YAML text of ``lines`` parses, or fails only after line ``at``."""
    try:
        yaml.compose("\n".join(lines), Loader=_ConfigLoader)
    except yaml.MarkedYAMLError as error:
        return error.problem_mark is not None and error.problem_mark.line > at
    except yaml.YAMLError:
        return False
    return True


_TOP_KEYS = set(
    "device_plugin_dir resources sysfs_root dev_root dra metrics_address health_address nfd_features_file".split()
)


def parse_config(text: str, source: str = "<config>") -> Config:
    """Parse and validate configuration YAML; raise ConfigError naming the first problem found."""
    try:
        data = yaml.load(text, Loader=_ConfigLoader)  # a SafeLoader, see _ConfigLoader
    # RecursionError: PyYAML composes nested nodes by recursion; ValueError: its scanner's chr() of an
    # escape past U+10FFFF ("\U00420577").
    except (yaml.YAMLError, RecursionError, ValueError) as error:
        said = str(error) if isinstance(error, _DuplicateKey) else _yaml_problem(text, error)
        raise ConfigError(source, "", said) from None
    for at, octal in _octal_numbers(data):
        read = f"{octal.written} is read by YAML as an octal number, {int(octal)}"
        if re.search(r"\.usb\[[0-9]+\]\.(vendor|product|serial)$", at):
            raise ConfigError(source, at, f'{read}: write it in quotes, as lsusb prints it ("{octal.written}")')
        decimal = octal.written.replace("_", "").lstrip("+-").lstrip("0") or "0"
        raise ConfigError(
            source, at, f"{read}: write {int(octal)} if you meant that, or {decimal} without the leading zero"
        )
    if data is None:  # nothing, or only comments: "must be a mapping" would not say what is wrong
        raise ConfigError(
            source, "", "is empty: it needs resources, a list of the devices to offer (docs/configuration.md)"
        )
    _refuse_generic_device_plugin_keys(data, source, "")  # before _mapping's "unknown key"
    top = _mapping(data, source, "", _TOP_KEYS, required={"resources"})
    device_plugin_dir = None
    if "device_plugin_dir" in top:
        device_plugin_dir = _absolute_path(top["device_plugin_dir"], source, "device_plugin_dir")
        if (problem := device_plugin_dir_problem(device_plugin_dir)) is not None:
            raise ConfigError(source, "device_plugin_dir", problem)
    sysfs_root = _absolute_path(top.get("sysfs_root", "/sys"), source, "sysfs_root")
    dev_root = _absolute_path(top.get("dev_root", "/dev"), source, "dev_root")
    dra = _parse_dra(top["dra"], source, "dra") if "dra" in top else None
    metrics_address = health_address = None
    if "metrics_address" in top:
        metrics_address = _string(top["metrics_address"], source, "metrics_address")
        if (problem := metrics_address_problem(metrics_address)) is not None:
            raise ConfigError(source, "metrics_address", problem)
    if "health_address" in top:
        health_address = _string(top["health_address"], source, "health_address")
        if (problem := metrics_address_problem(health_address, 9402)) is not None:
            raise ConfigError(source, "health_address", problem)
    nfd_features_file = None
    if "nfd_features_file" in top:
        nfd_features_file = _absolute_path(top["nfd_features_file"], source, "nfd_features_file")
        if (problem := nfd_features_file_problem(nfd_features_file)) is not None:
            raise ConfigError(source, "nfd_features_file", problem)
    entries = top["resources"]
    if not isinstance(entries, list) or not entries:
        raise ConfigError(source, "resources", "must be a non-empty list of resources")
    resources: list[ResourceConfig] = []
    for index, entry in enumerate(entries):
        resource = _parse_resource(entry, source, f"resources[{index}]", dev_root, dra)
        for earlier, other in enumerate(resources):
            if other.name == resource.name:
                raise ConfigError(
                    source, f"resources[{index}].name", f"{resource.name} is already used by resources[{earlier}]"
                )
            if resource.cdi and other.cdi and resource.cdi.spec_file == other.cdi.spec_file:
                problem = (
                    f"{resource.cdi.kind!r} would share the CDI spec file {resource.cdi.spec_file} with "
                    f"resources[{earlier}]: give each resource its own kind"
                )
                raise ConfigError(source, f"resources[{index}].cdi.kind", problem)
            # Allocate's env (a DRA claim's CDI device) sets it: a container given devices of both would have
            # one list, overwritten by the other. Two resources that offer the same devices may share one.
            sharing = resource.name in other.shared_with or other.name in resource.shared_with
            if resource.env == other.env and not sharing:
                problem = f"{resource.env} is also the env of {other.name} (resources[{earlier}]): a container given "
                problem += f"devices of both would see one list; set another env on {resource.name}, or shared_with "
                problem += "if both offer the same devices"
                raise ConfigError(source, f"resources[{index}].env", problem)
            if resource.dra and other.dra and dra_pool_suffix(resource.name) == dra_pool_suffix(other.name):
                problem = f"{resource.name} would share a DRA pool name with {other.name} of resources[{earlier}]"
                raise ConfigError(source, f"resources[{index}].name", problem)
        if (
            dra
            and dra.device_metadata
            and resource.dra
            and resource.cdi
            and resource.cdi.kind == dra_metadata_cdi_kind(dra.driver)
        ):
            # Its claims' CDI spec files would have the metadata's names (ClaimCDISpec), each overwriting the other.
            at = f"resources[{index}].cdi.kind" if "cdi" in entry else f"resources[{index}].name"
            problem = f"{resource.cdi.kind!r} is the CDI kind of the device metadata gopherplug mounts into claims' "
            problem += "containers (dra.device_metadata): give the resource another cdi.kind"
            raise ConfigError(source, at, problem)
        resources.append(resource)
    names = [resource.name for resource in resources]
    for index, resource in enumerate(resources):
        for i, sharer in enumerate(resource.shared_with):
            if sharer == resource.name or sharer not in names:
                what = "is this resource itself" if sharer == resource.name else "names no resource of this file"
                why = f"{sharer!r} {what}: list the resources that may offer the same device nodes as this one"
                raise ConfigError(source, f"resources[{index}].shared_with[{i}]", why)
    if dra is not None and not any(resource.dra for resource in resources):
        raise ConfigError(source, "dra", "no resource has api: dra, so the driver would offer nothing")
    warnings = tuple(
        str(ConfigError(source, f"resources[{index}].{key}", problem))
        for index, entry in enumerate(entries)
        for key, problem in [
            *_resource_warnings(entry, dra.driver if dra else ""),
            ("attributes", _room_warning(resources[index])),
        ]
        if problem
    )
    return Config(
        tuple(resources),
        device_plugin_dir,
        source,
        sysfs_root,
        dev_root,
        dra,
        metrics_address,
        warnings,
        health_address=health_address,
        nfd_features_file=nfd_features_file,
    )


# generic-device-plugin's keys (squat/generic-device-plugin, config.go: a --config file's `devices`,
# each --device document's `groups`, a group's `paths`), with what gopherplug has instead. A file
# carried over from it is told where its translation is, not only that its keys are unknown.
_GENERIC_DEVICE_PLUGIN_KEYS = {
    "devices": "gopherplug's configuration lists resources instead, one for each of its devices",
    "device": "gopherplug's configuration lists resources instead, one for each --device",
    "groups": "a resource here has directory and pattern, match or usb instead, and replicas for count",
    "paths": "a resource here has directory and pattern instead, a glob of the entries of one directory",
}


def _refuse_generic_device_plugin_keys(data: Any, source: str, where: str) -> None:
    """Raise ConfigError for the first of generic-device-plugin's keys in the mapping ``data``."""
    for key in data if isinstance(data, dict) else ():
        if key in _GENERIC_DEVICE_PLUGIN_KEYS:
            problem = f"is generic-device-plugin's, not gopherplug's: {_GENERIC_DEVICE_PLUGIN_KEYS[key]} "
            problem += "(docs/generic-device-plugin.md translates each of its keys)"
            raise ConfigError(source, f"{where}.{key}", problem)


#: Where Node Feature Discovery's local source reads feature files (featureFilesDir in
#: kubernetes-sigs/node-feature-discovery source/local/local.go): nfd-worker mounts the host's.
NFD_FEATURES_DIR = "/etc/kubernetes/node-feature-discovery/features.d"


def nfd_features_file_problem(path: str) -> str | None:
    """Why NFD would never read a feature file at ``path`` (absolute, normalized), or None. Its
    local source reads the files of its directory only, not of directories under it, and skips a
    name beginning with "." (local.go's getFeaturesFromFiles)."""
    name = os.path.basename(path)
    if not name or name.startswith("."):
        return (
            f"{path!r}: NFD skips a file whose name begins with '.': name the file, e.g. {NFD_FEATURES_DIR}/gopherplug"
        )
    return None


def metrics_address_problem(address: str, example: int = 9400) -> str | None:
    """What is wrong with a metrics (or health) address ("host:port", "[::1]:port"), or None."""
    host, colon, port = address.rpartition(":")
    if not colon or not host or not (port.isascii() and port.isdigit()) or int(port) > 65535:
        return f'{address!r} is not host:port, e.g. "0.0.0.0:{example}" (all addresses) or "127.0.0.1:{example}"'
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        return f'{address!r}: write an IPv6 address in brackets, e.g. "[::]:{port}"'
    return None


# Regular-expression syntax that a glob (fnmatch) takes as the characters themselves: "tty\d+"
# matches only a name with a backslash and a plus in it, so it finds nothing, and says nothing.
_REGEX_SIGNS = re.compile(r"\\[dwsDWS.]|[+{}()|^$]|\.\*")
# The usual regex pieces, and the glob that says (nearly) the same.
_GLOB_FOR_REGEX: tuple[tuple[str, str], ...] = (
    (r"\d+", "[0-9]*"),
    ("[0-9]+", "[0-9]*"),
    (r"\d*", "*"),
    (r"\d", "[0-9]"),
    (r"\w+", "*"),
)
_GLOB_FOR_REGEX += ((".*", "*"), (".+", "?*"), (r"\.", "."))


def _resource_warnings(entry: dict[str, Any], driver: str) -> Iterator[tuple[str, str]]:
    """(key, problem) for each glob of a (valid) resource that looks like a regular expression, and
    each attribute named like a standard one but in the driver's domain, where selectors and
    constraints on the standard name (matchAttribute: resource.kubernetes.io/pcieRoot) never look."""
    for name in entry.get("attributes") or {}:
        domain, _, short = name.rpartition("/")
        if short in DRA_STANDARD_ATTRIBUTES and domain in ("", driver):
            standard = f"{DRA_STANDARD_DOMAIN}/{short}"
            said = f"is {driver or '<driver>'}/{short}, in the driver's domain, where matchAttribute: {standard} "
            yield f"attributes.{name}", said + f"never looks: name it {standard}, the standard attribute"
    patterns = [("pattern", entry.get("pattern"))]
    patterns += [(f"match[{i}].pattern", m.get("pattern")) for i, m in enumerate(entry.get("match") or [])]
    for key, pattern in patterns:
        if isinstance(pattern, str) and _REGEX_SIGNS.search(pattern):
            glob = pattern.removeprefix("^").removesuffix("$")
            for regex, instead in _GLOB_FOR_REGEX:
                glob = glob.replace(regex, instead)
            write = (
                f"write {_as_written(glob)}"
                if not _REGEX_SIGNS.search(glob)
                else "write it as a glob (alternatives: a match entry each)"
            )
            problem = (
                f"{_as_written(pattern)} looks like a regular expression, but pattern is a glob (fnmatch): {write}"
            )
            yield key, problem


def _parse_dra(data: Any, source: str, where: str) -> DraConfig:
    keys = {"driver", "kubelet_dir", "unhealthy_taint", "device_metadata"}
    data = _mapping(data, source, where, keys, {"driver"})
    driver = _string(data["driver"], source, f"{where}.driver")
    if not _DNS_SUBDOMAIN.fullmatch(driver) or len(driver) > MAX_DRIVER_NAME:
        problem = f"{driver!r}: must be a lower-case DNS subdomain of at most {MAX_DRIVER_NAME} characters"
        problem += ", e.g. gopherplug.example.com"
        raise ConfigError(source, f"{where}.driver", problem)
    effect = data.get("unhealthy_taint", "NoSchedule")
    if effect not in DRA_TAINT_EFFECTS:
        problem = f"{effect!r}: must be NoSchedule (keep new claims off an unhealthy device) or NoExecute (also evict)"
        raise ConfigError(source, f"{where}.unhealthy_taint", problem)
    device_metadata = data.get("device_metadata", True)
    if not isinstance(device_metadata, bool):
        problem = f"{device_metadata!r}: must be true (the default: each claim's containers get a file describing "
        problem += "their devices) or false"
        raise ConfigError(source, f"{where}.device_metadata", problem)
    kubelet_dir = _absolute_path(data.get("kubelet_dir", DEFAULT_KUBELET_DIR), source, f"{where}.kubelet_dir")
    config = DraConfig(driver, kubelet_dir, effect, device_metadata=device_metadata)
    if too_long := dra_socket_problem(config):
        raise ConfigError(source, where, too_long)
    return config


def dra_socket_problem(config: DraConfig) -> str | None:
    """Why the driver's sockets cannot be made (a path too long for a unix socket), or None."""
    for path in (config.registration_socket, config.endpoint):
        if len(path) > MAX_SOCKET_PATH:
            problem = f"the socket {path} would pass the {MAX_SOCKET_PATH} bytes unix sockets allow: "
            return problem + "choose a shorter driver name"
    return None


def with_pod_uid(config: Config, pod_uid: str, source: str = POD_UID_ENV) -> Config:
    """``config`` with its DRA driver told this pod's UID (see DraConfig.pod_uid); as it is without
    ``dra`` or a UID. Raises ConfigError naming ``source`` when the UID cannot be part of a file name."""
    if config.dra is None or not pod_uid:
        return config
    if not _POD_UID.fullmatch(pod_uid):
        problem = f"{pod_uid!r} is not a pod UID: set it from the downward API (valueFrom.fieldRef.fieldPath: "
        raise ConfigError(source, "", problem + "metadata.uid), or leave it unset")
    dra = dataclasses.replace(config.dra, pod_uid=pod_uid)
    if too_long := dra_socket_problem(dra):
        raise ConfigError(source, "", too_long)
    return dataclasses.replace(config, dra=dra)


_RESOURCE_KEYS = set(
    "name directory pattern match id_pattern usb env device_specs mounts annotations replicas preferred cdi pre_start "
    "pre_start_timeout allowed_host_paths api whole_dev allow_mounted shared_with attributes capacity describe".split()
)
MAX_REPLICAS = 1000


def _parse_resource(
    entry: Any, source: str, where: str, dev_root: str = "/dev", dra: DraConfig | None = None
) -> ResourceConfig:
    if isinstance(entry, dict) and "allow_double_booking" in entry:  # before _mapping's "unknown key"
        raise ConfigError(source, f"{where}.allow_double_booking", f"is no longer accepted: {_ONE_API}")
    _refuse_generic_device_plugin_keys(entry, source, where)
    data = _mapping(entry, source, where, _RESOURCE_KEYS, required={"name"})
    name = _string(data["name"], source, f"{where}.name")
    if (problem := resource_name_problem(name)) is not None:
        raise ConfigError(source, f"{where}.name", f"{name!r}: {problem}")
    api = _parse_api(data, source, where, dra)
    directory, pattern, match = _parse_sources(data, source, where)
    usb = tuple(
        _parse_usb(selector, source, f"{where}.usb[{i}]")
        for i, selector in enumerate(_list(data.get("usb", []), source, f"{where}.usb"))
    )
    if not directory and not match and not usb:
        raise ConfigError(source, f"{where}.directory", "is required, unless match or usb says where the devices are")
    if usb and (directory or match):
        # Each would silently add to the other's devices: a resource says where its devices are once.
        problem = f"and {'directory' if directory else 'match'} in one resource would offer both kinds of device "
        problem += "as one list: give the USB devices a resource of their own"
        raise ConfigError(source, f"{where}.usb", problem)
    id_pattern = None
    if "id_pattern" in data:
        if not directory and not match:
            problem = "names directory entries, and this resource has none: a USB device's ID is its serial or port"
            raise ConfigError(source, f"{where}.id_pattern", problem)
        id_pattern = _parse_id_pattern(data["id_pattern"], source, f"{where}.id_pattern")
    env = _string(data.get("env", default_env_name(name)), source, f"{where}.env")
    if not _ENV_NAME.fullmatch(env):
        raise ConfigError(source, f"{where}.env", f"{env!r} is not a valid environment variable name")
    if env.startswith("LD_") or env in _LOADER_ENV or env in _SHELL_ENV:
        problem = f"{env!r} is given meaning by the shell or the dynamic loader: choose another name"
        if "env" not in data:  # the name's own: the user wrote no env to change
            problem = f"{env!r}, the default for {name!r}, is given meaning by the shell or the dynamic loader: set env"
        raise ConfigError(source, f"{where}.env", problem)
    if env == "GOPHERPLUG_RESOURCE":  # run_pre_start sets it after the env var: the devices would be lost
        raise ConfigError(source, f"{where}.env", f"{env!r} is set by gopherplug for pre_start: choose another name")
    allowed = tuple(
        _allowed_root(path, source, f"{where}.allowed_host_paths[{i}]")
        for i, path in enumerate(_list(data.get("allowed_host_paths", []), source, f"{where}.allowed_host_paths"))
    )
    whole_dev, allow_mounted = (_flag(data, key, source, where) for key in ("whole_dev", "allow_mounted"))
    # All of /dev offered read-write hands a pod the disks, kmsg and mem: never by a default pattern.
    written = [(f"{where}.match[{i}]", entry) for i, entry in enumerate(data["match"])] if match else [(where, data)]
    everything = [
        (f"{at}.pattern", src.pattern, "" if "pattern" in entry else " (the default)")
        for (at, entry), src in zip(
            written, match or ((Source(directory, pattern),) if directory else ()), strict=False
        )
        if os.path.normpath(src.directory) == os.path.normpath(dev_root) and not src.pattern.strip("*")
    ]
    if everything and not whole_dev:
        key, glob, default = everything[0]
        problem = (
            f"{_as_written(glob)}{default} in {dev_root} offers every entry there read-write, disks, kmsg and mem "
            "among them: name the devices (e.g. 'ttyUSB*'), or set whole_dev: true"
        )
        raise ConfigError(source, key, problem)
    if whole_dev and not everything:
        problem = f"is for a pattern that matches every entry of {dev_root}, and this resource has none: remove it"
        raise ConfigError(source, f"{where}.whole_dev", problem)
    directories = [directory] if directory else [m.directory for m in match]
    in_dev = usb or any(_is_under(d, [dev_root]) for d in directories)
    roots = tuple(dict.fromkeys([*directories, *allowed, *([dev_root] if in_dev else [])]))
    device_specs = None
    if "device_specs" in data:
        device_specs = tuple(
            _parse_device_spec(spec, source, f"{where}.device_specs[{i}]", roots)
            for i, spec in enumerate(_list(data["device_specs"], source, f"{where}.device_specs"))
        )
    mounts = tuple(
        _parse_mount(mount, source, f"{where}.mounts[{i}]", roots)
        for i, mount in enumerate(_list(data.get("mounts", []), source, f"{where}.mounts"))
    )
    annotations = _parse_annotations(data.get("annotations", {}), source, f"{where}.annotations")
    replicas = data.get("replicas", 1)
    if isinstance(replicas, bool) or not isinstance(replicas, int) or not 1 <= replicas <= MAX_REPLICAS:
        raise ConfigError(source, f"{where}.replicas", f"{replicas!r}: must be a whole number from 1 to {MAX_REPLICAS}")
    preferred = data.get("preferred", "packed")
    if preferred not in ("packed", "spread"):
        raise ConfigError(source, f"{where}.preferred", f"{preferred!r}: must be packed or spread")
    cdi = None
    if "cdi" in data:
        cdi = _parse_cdi(data["cdi"], source, f"{where}.cdi")
    elif api != "device-plugin":
        assert dra is not None
        cdi = _parse_cdi({"kind": dra_cdi_kind(dra.driver, name)}, source, f"{where}.cdi")
    if cdi is not None:
        # The CDI spec sets <env>_<ID> per device: "LD" and a device "preload" would be LD_PRELOAD.
        prefix = env + "_"
        if prefix == "LD_" or any(name.startswith(prefix) for name in _LOADER_ENV | _SHELL_ENV):
            problem = f"{env!r}: with cdi, each device sets {env}_<ID>, which could name a variable the shell or "
            problem += "the dynamic loader give meaning to: choose another name"
            raise ConfigError(source, f"{where}.env", problem)
        templates = [(f"device_specs[{i}]", spec.container_path) for i, spec in enumerate(device_specs or ())]
        templates += [(f"mounts[{i}]", mount.container_path) for i, mount in enumerate(mounts)]
        for key, template in templates:
            if "index" in _placeholders(template):
                problem = (
                    f"{template!r}: with cdi, a device is described once, not per allocation: "
                    "use {id} instead of {index}"
                )
                raise ConfigError(source, f"{where}.{key}.container_path", problem)
    pre_start: tuple[str, ...] = ()
    if "pre_start" in data:
        pre_start = _parse_command(data["pre_start"], source, f"{where}.pre_start")
    timeout = data.get("pre_start_timeout", 25)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout < KUBELET_PRE_START_TIMEOUT:
        problem = f"{timeout!r}: must be a number of seconds, more than 0 and less than the kubelet's 30"
        raise ConfigError(source, f"{where}.pre_start_timeout", problem)
    if api == "dra":
        # What the device-plugin API alone has: refused, so that nothing given is silently unused.
        # (replicas is DRA's too: shares of each device, dra_device.)
        if only := [key for key in _DRA_INSTEAD if key in data]:
            problem = f"is for the device-plugin API, and this resource has api: dra ({_DRA_INSTEAD[only[0]]})"
            raise ConfigError(source, f"{where}.{only[0]}", problem)
    shared_with = tuple(
        _string(other, source, f"{where}.shared_with[{i}]")
        for i, other in enumerate(_list(data.get("shared_with", []), source, f"{where}.shared_with"))
    )
    attributes, capacity, describe = _parse_declarations(data, source, where, replicas, dra)
    return ResourceConfig(
        name=name,
        directory=directory,
        pattern=pattern,
        env=env,
        device_specs=device_specs,
        mounts=mounts,
        annotations=annotations,
        replicas=replicas,
        preferred=preferred,
        cdi=cdi,
        pre_start=pre_start,
        pre_start_timeout=float(timeout),
        allowed_host_paths=allowed,
        match=match,
        id_pattern=id_pattern,
        usb=usb,
        api=api,
        allow_mounted=allow_mounted,
        shared_with=shared_with,
        attributes=attributes,
        capacity=capacity,
        describe=describe,
        driver=dra.driver if dra is not None else "",
    )


def _flag(data: dict[str, Any], key: str, source: str, where: str) -> bool:
    """An optional true/false key, default false."""
    value = data.get(key, False)
    if not isinstance(value, bool):
        raise ConfigError(source, f"{where}.{key}", f"{value!r}: must be true or false")
    return value


# What DRA has instead of the device-plugin options it refuses.
_DRA_INSTEAD = {
    "preferred": "the scheduler chooses devices, by the claim's selectors",
    "annotations": "devices reach containers only as CDI devices",
}

#: The longest DRA driver name the API server accepts in a ResourceSlice (a DNS subdomain of at most 63).
MAX_DRIVER_NAME = 63


def _parse_api(data: dict[str, Any], source: str, where: str, dra: DraConfig | None) -> str:
    """``api``: which API offers the devices on this node."""
    api = data.get("api", "device-plugin")
    if api == "both":
        raise ConfigError(source, f"{where}.api", f"both is no longer accepted: {_ONE_API}")
    if api not in APIS:
        raise ConfigError(source, f"{where}.api", f"{api!r}: must be one of {', '.join(APIS)}")
    if api != "device-plugin" and dra is None:
        problem = f"{api} needs the DRA driver: add dra: {{driver: <name>}} at the top of the file"
        raise ConfigError(source, f"{where}.api", problem)
    if api != "device-plugin" and len(data["name"]) > DRA_ATTRIBUTE_MAX_LENGTH:
        problem = f"with api: {api}, the name is a device attribute: at most {DRA_ATTRIBUTE_MAX_LENGTH} characters"
        raise ConfigError(source, f"{where}.name", problem)
    return str(api)


def _parse_sources(data: dict[str, Any], source: str, where: str) -> tuple[str, str, tuple[Source, ...]]:
    """``directory`` and ``pattern``, or ``match``: a list of them."""
    if "match" not in data:
        directory = _absolute_path(data["directory"], source, f"{where}.directory") if "directory" in data else ""
        if "pattern" in data and not directory:
            raise ConfigError(source, f"{where}.pattern", "names entries of a directory: give directory too")
        return directory, _string(data.get("pattern", "*"), source, f"{where}.pattern"), ()
    for key in ("directory", "pattern"):
        if key in data:
            problem = "goes in a match entry when match is given (directory and pattern are a match of one)"
            raise ConfigError(source, f"{where}.{key}", problem)
    entries = _list(data["match"], source, f"{where}.match")
    if not entries:
        raise ConfigError(source, f"{where}.match", "must list at least one {directory, pattern}")
    match: list[Source] = []
    for i, entry in enumerate(entries):
        at = f"{where}.match[{i}]"
        fields = _mapping(entry, source, at, {"directory", "pattern"}, {"directory"})
        found = Source(
            _absolute_path(fields["directory"], source, f"{at}.directory"),
            _string(fields.get("pattern", "*"), source, f"{at}.pattern"),
        )
        if found in match:
            raise ConfigError(source, at, f"repeats match[{match.index(found)}]")
        match.append(found)
    return "", "*", tuple(match)


def _as_written(text: str) -> str:
    """A pattern quoted as the user wrote it: repr() would double each backslash of a regex (a
    pattern with a newline or the like is still shown by repr, to stay on one line)."""
    return f"'{text}'" if text.isprintable() else repr(text)


def _parse_id_pattern(value: Any, source: str, where: str) -> re.Pattern[str]:
    text = _string(value, source, where)
    try:
        compiled = re.compile(text)
    except re.error as error:
        raise ConfigError(source, where, f"{_as_written(text)} is not a regular expression: {error}") from None
    if "id" not in compiled.groupindex:
        problem = (
            f"{_as_written(text)} has no group named id: mark the part of the name that is the ID with (?P<id>...)"
        )
        raise ConfigError(source, where, problem)
    return compiled


def _parse_usb(entry: Any, source: str, where: str) -> UsbSelector:
    data = _mapping(entry, source, where, {"vendor", "product", "serial"}, {"vendor", "product"})
    ids = []
    for key in ("vendor", "product"):
        value = data[key]
        if not isinstance(value, str) or not re.fullmatch(r"[0-9A-Fa-f]{4}", value):
            # YAML reads 1050 as a number (0407, octal, is refused before: see _ConfigLoader): the user meant text.
            problem = f'{value!r}: must be 4 hex digits in quotes, as lsusb prints them (e.g. "0407")'
            raise ConfigError(source, f"{where}.{key}", problem)
        ids.append(value.lower())
    serial = _string(data["serial"], source, f"{where}.serial") if "serial" in data else None
    return UsbSelector(ids[0], ids[1], serial)


def _parse_device_spec(entry: Any, source: str, where: str, roots: tuple[str, ...]) -> DeviceSpecTemplate:
    data = _mapping(
        entry, source, where, {"host_path", "container_path", "permissions"}, {"host_path", "container_path"}
    )
    host_path = _host_path_template(data["host_path"], source, f"{where}.host_path", roots)
    container_path = _template(data["container_path"], source, f"{where}.container_path")
    permissions = _string(data.get("permissions", "rw"), source, f"{where}.permissions")
    if not permissions or set(permissions) - set("rwm") or len(set(permissions)) != len(permissions):
        raise ConfigError(source, f"{where}.permissions", f"{permissions!r}: use letters from r, w and m, each once")
    return DeviceSpecTemplate(host_path, container_path, permissions)


def _parse_mount(entry: Any, source: str, where: str, roots: tuple[str, ...]) -> MountTemplate:
    data = _mapping(entry, source, where, {"host_path", "container_path", "read_only"}, {"host_path", "container_path"})
    host_path = _host_path_template(data["host_path"], source, f"{where}.host_path", roots)
    container_path = _template(data["container_path"], source, f"{where}.container_path")
    read_only = data.get("read_only", True)
    if not isinstance(read_only, bool):
        raise ConfigError(source, f"{where}.read_only", f"{read_only!r}: must be true or false")
    return MountTemplate(host_path, container_path, read_only)


# Annotation keys as Kubernetes validates them: an optional DNS-subdomain prefix and "/", then a
# qualified name of at most 63 characters.
_ANNOTATION_KEY = re.compile(rf"(({_DNS_SUBDOMAIN.pattern})/)?{_QUALIFIED_NAME.pattern}")


def _parse_annotations(data: Any, source: str, where: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(data, dict):
        raise ConfigError(source, where, "must be a mapping of annotation keys to values")
    annotations = []
    for key, value in data.items():
        key = _string(key, source, where)
        if _placeholders(key, source, f"{where}.{key}") - {"id", "index"}:
            raise ConfigError(source, f"{where}.{key}", "a key can use {id} and {index}, not a path or name")
        sample = key.format(**_TEMPLATE_FIELDS)
        if not _ANNOTATION_KEY.fullmatch(sample) or len(sample.rpartition("/")[2]) > 63:
            problem = "not a valid annotation key: [prefix/]name, a name of at most 63 letters, digits, '-', '_', '.'"
            raise ConfigError(source, f"{where}.{key}", problem)
        if not isinstance(value, str):
            raise ConfigError(source, f"{where}.{key}", f"{value!r}: must be a string (quote it)")
        if _placeholders(value, source, f"{where}.{key}") & {"name", "target"}:
            problem = f"{value!r}: an annotation is per device, not per entry: use {{id}}, {{path}} or {{index}}"
            raise ConfigError(source, f"{where}.{key}", problem)
        annotations.append((key, value))
    return tuple(annotations)


# Attributes and capacity (Device.attributes and .capacity in k8s.io/api resource/v1), checked as the
# API server checks them (kubernetes/kubernetes pkg/apis/resource/validation/validation.go): one bad
# value refuses the slice, and the pool with it. In the configuration, a ConfigError; read, left out.

#: The most attributes and capacities one device may have together
#: (ResourceSliceMaxAttributesAndCapacitiesPerDevice in k8s.io/api resource/v1)
DRA_MAX_ATTRIBUTES_AND_CAPACITIES = 32
#: The longest name of an attribute or capacity, without its domain (DeviceMaxIDLength), and its
#: domain (DeviceMaxDomainLength, a driver name's limit)
DRA_ATTRIBUTE_NAME_MAX_LENGTH = 32
DRA_ATTRIBUTE_DOMAIN_MAX_LENGTH = 63
_C_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# A driver name's check, which takes upper case too (validateDriverName lower-cases it first). Only
# ASCII: Go's ToLower makes the Kelvin sign a "k", three bytes that Python's len() counts as one.
_ATTRIBUTE_DOMAIN = re.compile(_DNS_SUBDOMAIN.pattern, re.IGNORECASE | re.ASCII)
# A version attribute's value: semver.org 2.0.0, as the API server's semverRe says it (Go's \d is [0-9]).
_SEMVER = re.compile(
    r"(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)"
    r"(-(0|[1-9][0-9]*|[0-9]*[a-zA-Z-][0-9a-zA-Z-]*)(\.(0|[1-9][0-9]*|[0-9]*[a-zA-Z-][0-9a-zA-Z-]*))*)?"
    r"(\+[0-9a-zA-Z-]+(\.[0-9a-zA-Z-]+)*)?"
)

#: The attributes gopherplug gives every device itself, in the driver's domain (dra_device): a
#: declared one of the same name is refused, rather than one silently hiding the other.
OWN_ATTRIBUTES = frozenset(
    {"resource", "id", "healthy", "numaNode", "usbVendor", "usbProduct", "usbSerial", "usbBus", "usbPort"}
)


def attribute_name_problem(name: str) -> str:
    """Why the API server would refuse ``name`` as an attribute's or a capacity's (validateQualifiedName),
    or "": a C identifier of at most 32 characters, after an optional domain (a DNS subdomain of at
    most 63) and "/"."""
    parts = name.split("/")
    if len(parts) > 2:
        return "must be either a C identifier or a domain, followed by a slash and a C identifier"
    problems, domain, identifier = [], parts[0] if len(parts) == 2 else None, parts[-1]
    if domain == "":
        problems.append("the domain must not be empty")
    elif domain and (len(domain) > DRA_ATTRIBUTE_DOMAIN_MAX_LENGTH or not _ATTRIBUTE_DOMAIN.fullmatch(domain)):
        problems.append(
            f"the domain {domain!r} must be a DNS subdomain (letters, digits, '-' and '.') "
            f"of at most {DRA_ATTRIBUTE_DOMAIN_MAX_LENGTH} characters"
        )
    if not identifier:
        problems.append("the name must not be empty")
    elif not _C_IDENTIFIER.fullmatch(identifier) or len(identifier) > DRA_ATTRIBUTE_NAME_MAX_LENGTH:
        problems.append(
            f"{identifier!r} must be a C identifier (letters, digits and '_', not starting with a digit) "
            f"of at most {DRA_ATTRIBUTE_NAME_MAX_LENGTH} characters"
        )
    return "; ".join(problems)


def attribute_value_problem(kind: str, value: Any) -> str:
    """Why the API server would refuse ``value`` as an attribute of type ``kind`` (validateDeviceAttribute),
    or "": a string or version of at most 64 bytes, a version semver.org 2.0.0, an int an int64."""
    if kind == "bool":
        return "" if isinstance(value, bool) else f"{value!r} is not true or false"
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            return f"{value!r} is not a whole number"
        return "" if -(2**63) <= value < 2**63 else f"{value} does not fit in 64 bits"  # an int64
    if kind not in ("string", "version"):
        return f'{value!r} is not a string, a whole number, true or false, or {{"version": "1.2.3"}}'
    if not isinstance(value, str):
        return f"{value!r} is not a string"
    if (size := len(value.encode(errors="surrogatepass"))) > DRA_ATTRIBUTE_MAX_LENGTH:
        return f"{value[:20]!r}... has {size} bytes, more than the API server's {DRA_ATTRIBUTE_MAX_LENGTH}"
    if re.search("[\ud800-\udfff]", value):  # JSON's "\ud800": not UTF-8 (Go's decoder would keep U+FFFD)
        return f"{value!r} has a lone surrogate: it is not UTF-8"
    if kind == "version" and not _SEMVER.fullmatch(value):
        return f"{value!r} is not a semantic version (semver.org 2.0.0: MAJOR.MINOR.PATCH, e.g. 1.2.3)"
    return ""


# A resource.Quantity as the API server parses one (ParseQuantity in k8s.io/apimachinery
# pkg/api/resource/quantity.go): a signed decimal number, then a binary suffix (Ki ... Ei), a
# decimal one (n u m "" k M G T P E) or an exponent (e3, E-2). Digits are ASCII, as Go reads them.
_QUANTITY = re.compile(r"([+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+))(?:(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE])|[eE]([+-]?[0-9]+))?")
_BINARY_SUFFIXES = ("", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei")
_DECIMAL_SUFFIXES = {-9: "n", -6: "u", -3: "m", 0: "", 3: "k", 6: "M", 9: "G", 12: "T", 15: "P", 18: "E"}


@functools.lru_cache(maxsize=1024, typed=True)  # a node's devices mostly say the same few quantities
def canonical_quantity(written: str | int | float) -> str | None:
    """A quantity as the API server stores it, None when it would refuse it (ParseQuantity, then
    CanonicalizeBytes in k8s.io/apimachinery pkg/api/resource/quantity.go): "1.5Gi" is "1536Mi",
    "1000" is "1k", "0.5" is "500m"; written otherwise, the slice publisher would take each for a
    field the server dropped. Binary (Ki..Ei) while a whole number of at least 1024 (past 2^63-1,
    the server's cap), else a whole mantissa and an exponent that is a multiple of 3, as an SI
    suffix (or e<exponent> when written so, or past E); finer than 1n is rounded up. Refused
    besides: an exponent past the server's int32 scale (1.36 wraps it), and above 1E more than 18
    digits, which it would work out in big numbers as long as the exponent (1234567890123456789e9999999)."""
    if isinstance(written, bool):
        return None
    import decimal  # only where a quantity is written: most configurations have none

    text = (
        written if isinstance(written, str) else str(decimal.Decimal(written) if isinstance(written, int) else written)
    )
    if (match := _QUANTITY.fullmatch(text)) is None:
        return None
    number, suffix, exponent = match[1], match[2] or "", match[3]
    if exponent is not None and (len(exponent.lstrip("+-").lstrip("0")) > 10 or abs(int(exponent)) > 2**31 - 1):
        return None
    with decimal.localcontext(decimal.Context(decimal.MAX_PREC, Emax=decimal.MAX_EMAX, Emin=decimal.MIN_EMIN)):
        value = decimal.Decimal(number)  # exact: no rounding but the parser's own
        if suffix in _BINARY_SUFFIXES[1:]:
            value *= 1024 ** _BINARY_SUFFIXES.index(suffix)
            value = min(abs(value), decimal.Decimal(2**63 - 1)).copy_sign(value)
        else:
            value = value.scaleb(
                int(exponent) if exponent else next(e for e, s in _DECIMAL_SUFFIXES.items() if s == suffix)
            )
        value = value.scaleb(9).to_integral_value(decimal.ROUND_UP).scaleb(-9)  # nano is the finest
        if not value:
            return "0"
        if suffix in _BINARY_SUFFIXES[1:] and abs(value) >= 1024 and value == value.to_integral_value():
            whole, power = int(value), 0
            while power < len(_BINARY_SUFFIXES) - 1 and whole % 1024 == 0:
                whole, power = whole // 1024, power + 1
            return f"{whole}{_BINARY_SUFFIXES[power]}"
        sign, digits, places = value.normalize().as_tuple()
        assert isinstance(places, int)
        mantissa = "-" * sign + "".join(map(str, digits)) + "0" * (places % 3)
        places -= places % 3
        if places > 2**31 - 1 or (places > 18 and len(mantissa) - sign > 18):
            return None
        if exponent is not None or places not in _DECIMAL_SUFFIXES:
            return f"{mantissa}e{places}" if places else mantissa
        return f"{mantissa}{_DECIMAL_SUFFIXES[places]}"


_FILE_FIELDS = ("id", "path", "name", "target", "sysfs")


def _parse_declared(data: Any, source: str, where: str, capacity: bool, driver: str) -> tuple[DeclaredValue, ...]:
    """``attributes`` or ``capacity``: name -> a literal, or {file: <template>, type: ...}."""
    if not isinstance(data, dict):
        what = "capacity names to quantities" if capacity else "attribute names to values"
        raise ConfigError(source, where, f"must be a mapping of {what}")
    declared = []
    for name, value in data.items():
        at = f"{where}.{name}"
        name = _string(name, source, where)
        if problem := attribute_name_problem(name):
            raise ConfigError(source, at, f"not a valid name for the API server: {problem}")
        domain, _, short = name.rpartition("/")
        if not capacity and short in OWN_ATTRIBUTES and domain in ("", driver):
            problem = f"is an attribute gopherplug gives every device itself ({', '.join(sorted(OWN_ATTRIBUTES))}): "
            problem += "choose another name, or one in a domain of your own (example.com/" + short + ")"
            raise ConfigError(source, at, problem)
        if capacity and name == DRA_SHARES_CAPACITY:
            raise ConfigError(
                source, at, "is the capacity gopherplug gives a shared device (replicas): choose another name"
            )
        declared.append(_parse_declared_value(name, value, source, at, capacity))
    return tuple(declared)


def _parse_declared_value(name: str, value: Any, source: str, at: str, capacity: bool) -> DeclaredValue:
    if isinstance(value, dict) and "file" in value:
        types = ("quantity",) if capacity else ATTRIBUTE_TYPES
        data = _mapping(value, source, at, {"file", "type"}, {"file"})
        template = _string(data["file"], source, f"{at}.file")
        try:
            fields = {field for _, field, _, _ in string.Formatter().parse(template) if field is not None}
            sample = template.format(**{field: "x" if field in ("id", "name") else "/x" for field in _FILE_FIELDS})
        except (KeyError, IndexError, ValueError) as error:
            problem = f"{template!r}: bad placeholder ({error}); use {{{'}, {'.join(_FILE_FIELDS)}}}"
            raise ConfigError(source, f"{at}.file", problem) from None
        if not sample.startswith("/") or fields - set(_FILE_FIELDS):
            raise ConfigError(source, f"{at}.file", f"{template!r} must be an absolute path")
        kind = data.get("type", types[0])
        if kind not in types:
            raise ConfigError(source, f"{at}.type", f"{kind!r}: must be one of {', '.join(types)}")
        return DeclaredValue(name, kind, None, template)
    if capacity:
        quantity = canonical_quantity(value) if isinstance(value, str | int | float) else None
        if quantity is None:
            problem = f"{value!r} is not a quantity: a number with an optional suffix (4, 80Gi, 1500m, 2k), "
            problem += "or {file: <path>} to read one"
            raise ConfigError(source, at, problem)
        return DeclaredValue(name, "quantity", quantity)
    kind = {bool: "bool", int: "int", str: "string"}.get(type(value), "")
    if isinstance(value, dict) and len(value) == 1 and next(iter(value)) in ATTRIBUTE_TYPES:
        ((kind, value),) = value.items()  # {version: "1.2.3"}, or DeviceAttribute's own {string: ...} and the like
    if not kind:
        problem = f'{value!r}: must be a string, a whole number, true or false, {{version: "1.2.3"}}, '
        problem += "or {file: <path>, type: string|int|bool|version}"
        raise ConfigError(source, at, problem)
    if problem := attribute_value_problem(kind, value):
        raise ConfigError(source, at, f"not a valid {kind} attribute for the API server: {problem}")
    return DeclaredValue(name, kind, value)


def _parse_declarations(
    data: dict[str, Any], source: str, where: str, replicas: int, dra: DraConfig | None
) -> tuple[tuple[DeclaredValue, ...], tuple[DeclaredValue, ...], tuple[str, ...]]:
    """A resource's ``attributes``, ``capacity`` and ``describe``, validated."""
    driver = dra.driver if dra is not None else ""
    attributes = _parse_declared(data.get("attributes", {}), source, f"{where}.attributes", False, driver)
    capacity = _parse_declared(data.get("capacity", {}), source, f"{where}.capacity", True, driver)
    own = 3 + (replicas > 1)  # every device's resource, id and healthy; a shared one's "shares"
    if (total := len(attributes) + len(capacity) + own) > DRA_MAX_ATTRIBUTES_AND_CAPACITIES:
        problem = f"{len(attributes)} attributes and {len(capacity)} capacities, with the {own} gopherplug gives each "
        problem += f"device, are {total}: the API server takes at most {DRA_MAX_ATTRIBUTES_AND_CAPACITIES} a device"
        raise ConfigError(source, f"{where}.capacity" if capacity else f"{where}.attributes", problem)
    describe: tuple[str, ...] = ()
    if "describe" in data:
        describe = _parse_command(data["describe"], source, f"{where}.describe")
    return attributes, capacity, describe


def _room_warning(resource: ResourceConfig) -> str:
    """Why a DRA resource's devices may have more than the API server's 32 attributes and capacities
    once sysfs gives them its own (numaNode twice, pciBusID, pcieRoot; a USB device's five), or ""."""
    declared = len(resource.attributes) + len(resource.capacity) + 3 + (resource.replicas > 1)
    most = declared + 4 + 5 * bool(resource.usb)
    if not resource.dra or most <= DRA_MAX_ATTRIBUTES_AND_CAPACITIES:
        return ""
    kind = "USB device (NUMA node, PCI address, USB IDs)" if resource.usb else "PCI device (NUMA node, PCI address)"
    problem = f"with the capacities and gopherplug's own, {declared}, and up to {most - declared} sysfs gives a {kind} "
    return (
        problem + f"a device may have {most}: past {DRA_MAX_ATTRIBUTES_AND_CAPACITIES}, the last by name are left out"
    )


# CDI kinds: "vendor/class", the vendor a DNS subdomain, the class 2 to 63 of [A-Za-z0-9_.-]; both
# begin with an ASCII letter and end with one or a digit (ValidateVendorName, ValidateClassName in
# container-device-interface pkg/parser/parser.go). Not one character: CDI v1.1.0 (containerd 2.x's)
# panics on it at every start while the spec is there (container-device-interface#320).
_CDI_CLASS = re.compile(r"[A-Za-z]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?")
#: A vendor or class every CDI version takes: a letter, then at least one more character.
_CDI_SAFE_PART = re.compile(r"[A-Za-z][A-Za-z0-9_.-]*[A-Za-z0-9]")


def dra_cdi_kind(driver: str, resource_name: str) -> str:
    """The CDI kind of a DRA resource that sets no ``cdi``: "<driver>/<name part>", with an "x" in
    front of a part CDI would refuse or crash on ("example.com/3d" -> "<driver>/x3d"; "a" -> "xa"),
    which Kubernetes allows; within 63 characters, as a DRA resource's whole name has at most 64."""
    parts = (driver, resource_name.partition("/")[2])
    return "/".join(part if _CDI_SAFE_PART.fullmatch(part) else "x" + part for part in parts)


def _parse_cdi(data: Any, source: str, where: str) -> CDIConfig:
    data = _mapping(data, source, where, {"kind", "spec_dir"}, {"kind"})
    kind = _string(data["kind"], source, f"{where}.kind")
    vendor, _, device_class = kind.partition("/")
    if (
        not _DNS_SUBDOMAIN.fullmatch(vendor)
        or not vendor[:1].isalpha()
        or len(vendor) > 253
        or not _CDI_CLASS.fullmatch(device_class)
    ):
        problem = f"{kind!r}: must be vendor/class, e.g. example.com/gopher (a DNS name, then 2 to 63 of A-Z a-z "
        problem += "0-9 _ . -; each beginning with a letter)"
        raise ConfigError(source, f"{where}.kind", problem)
    if len(vendor) == 1 or len(device_class) == 1:
        problem = f"{kind!r}: a one-character vendor or class crashes containerd 2.x at every start (its CDI "
        problem += "library v1.1.0 panics on such a spec file): use 2 characters or more"
        raise ConfigError(source, f"{where}.kind", problem)
    if len(f".{kind}.json.lock") > 255:  # the spec file and its lock are named after the kind
        raise ConfigError(source, f"{where}.kind", f"{kind!r} is too long to name a file after: at most 244 characters")
    spec_dir = _absolute_path(data.get("spec_dir", "/var/run/cdi"), source, f"{where}.spec_dir")
    return CDIConfig(kind, spec_dir)


def _parse_command(data: Any, source: str, where: str) -> tuple[str, ...]:
    argv = tuple(_string(arg, source, f"{where}[{i}]") for i, arg in enumerate(_list(data, source, where)))
    if not argv:
        raise ConfigError(source, where, "must be a non-empty list: the program, then its arguments (no shell)")
    if "/" in argv[0] and not os.path.isabs(argv[0]):  # the configuration's path, not the working directory's
        if not os.path.isfile(source):
            problem = f"{argv[0]!r} is relative, and this configuration has no file here to resolve it against: "
            problem += "make it absolute"
            raise ConfigError(source, f"{where}[0]", problem)
        argv = (os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(source)), argv[0])), *argv[1:])
    if shutil.which(argv[0]) is None:
        raise ConfigError(source, f"{where}[0]", f"{argv[0]!r} is not an executable file here or on PATH")
    return argv


def _allowed_root(value: Any, source: str, where: str) -> str:
    path = _absolute_path(value, source, where)
    if path == "/":
        raise ConfigError(source, where, "'/' would allow every host path: list the directories you need")
    return path


def _host_path_template(value: Any, source: str, where: str, roots: tuple[str, ...]) -> str:
    template = _template(value, source, where)
    fields = _placeholders(template)
    if "index" in fields:
        problem = f"{template!r}: a host path can use {{id}}, {{path}}, {{name}} and {{target}}, not {{index}}"
        raise ConfigError(source, where, problem)
    if not fields and not _is_under(template, roots):
        # Checked again, after resolving symlinks, whenever devices are scanned.
        problem = f"{template!r} is outside {', '.join(roots)}: add its directory to allowed_host_paths"
        raise ConfigError(source, where, problem)
    return template


def _is_under(path: str, roots: Iterable[str]) -> bool:
    path = os.path.normpath(path)
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


def _placeholders(template: str, source: str = "", where: str = "") -> set[str]:
    """The {fields} of a template; with ``where``, a bad placeholder is a ConfigError."""
    try:
        template.format(**_TEMPLATE_FIELDS)
        return {field for _, field, _, _ in string.Formatter().parse(template) if field is not None}
    except (KeyError, IndexError, ValueError) as error:
        problem = f"{template!r}: bad placeholder ({error}); use {{id}}, {{path}}, {{name}}, {{target}} or {{index}}"
        raise ConfigError(source, where, problem) from None


def _list(value: Any, source: str, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise ConfigError(source, where, "must be a list")
    return value


def _mapping(data: Any, source: str, where: str, allowed: set[str], required: set[str]) -> dict[str, Any]:
    if not isinstance(data, dict):
        problem = "must be a mapping of keys to values"
        # A key without the space after its colon: YAML reads "kind:x" as one word, a string.
        key, colon, value = data.partition(":") if isinstance(data, str) else ("", "", "")
        if colon and key in allowed and value[:1] not in ("", " ") and data.isprintable():
            problem += f": write {key}: {value}, with a space after the colon ({data!r} is one word to YAML)"
        elif isinstance(data, list):
            problem += ", not a list: a key of a mapping takes no '- '"
        raise ConfigError(source, where, problem)
    for key in data:
        if key not in allowed:
            # A typo (pattren, device_plugins_dir) is told the key it most likely meant. difflib is
            # imported here, where a mistake is: a plugin whose configuration is right never needs it.
            import difflib

            close = difflib.get_close_matches(str(key), sorted(allowed), n=1)
            meant = f"did you mean {close[0]}? " if close else ""
            expected = f"unknown key; {meant}expected one of {', '.join(sorted(allowed))}"
            raise ConfigError(source, f"{where}.{key}" if where else str(key), expected)
    for key in sorted(required - data.keys()):
        raise ConfigError(source, f"{where}.{key}" if where else key, "is required")
    return data


def _string(value: Any, source: str, where: str) -> str:
    if isinstance(value, bool | int | float):  # YAML reads true, 7, 1.5 as such: the user meant text
        raise ConfigError(source, where, f"must be a non-empty string, not {value!r} (put it in quotes)")
    if not isinstance(value, str) or not value:
        raise ConfigError(source, where, "must be a non-empty string")
    return value


def _absolute_path(value: Any, source: str, where: str) -> str:
    path = _string(value, source, where)
    if not os.path.isabs(path):
        raise ConfigError(source, where, f"{path!r} must be an absolute path")
    return os.path.normpath(path)


def _template(value: Any, source: str, where: str) -> str:
    template = _string(value, source, where)
    _placeholders(template, source, where)
    if not template.format(**_TEMPLATE_FIELDS).startswith("/"):
        raise ConfigError(source, where, f"{template!r} must be an absolute path")
    return template


# 4b. Devices and directories: sources -> entries -> devices, healthy or not ---------------------------
# A run of ASCII digits, kept by re.split: "g12::3" -> ["g", "12", "::", "3", ""].
_DIGIT_RUN = re.compile(r"([0-9]+)")


def _natural_key(device_id: str) -> list[Any]:
    """Sort "gopher2" before "gopher10": digits compare as numbers (ASCII digits: the kubelet may
    send any string, and "²".isdigit() is true but int("²") fails).

    The key alternates text and number, and begins and ends with a text, maybe empty: "g12::3" ->
    ["g", 12, "::", 3, ""]. So a text only ever meets a text and a number a number, and an ID that
    begins with a number sorts first (its "" is the smallest text)."""
    parts: list[Any] = _DIGIT_RUN.split(device_id)
    parts[1::2] = map(int, parts[1::2])
    return parts


def _natural_sorted(ids: list[str]) -> list[str]:
    """The IDs in natural order; two with equal keys ("g01", "g1") in string order, so the result
    never depends on the order they came in."""
    ordered = _sorted_by_numbers(ids)
    if ordered is not None:
        return ordered
    # Several shapes ("gpu<n>" and "nvme<n>"): IDs whose texts before the first digit differ are in
    # the order of those texts (the first item of their keys), and each group may be of one shape.
    groups: dict[str, list[str]] = {}
    for i in ids:
        groups.setdefault(_DIGIT_RUN.split(i, 1)[0], []).append(i)
    if len(groups) == 1:
        return sorted(ids, key=lambda i: (_natural_key(i), i))
    return [i for text in sorted(groups) for i in _natural_sorted(groups[text])]


#: At most this many IDs are named in a line or an error (devices that came or went, IDs refused),
#: the others counted: a line built from what a peer sent stays short whatever it sent.
NAMED_CHANGES = 5


def _named(ids: list[str], most: int = NAMED_CHANGES) -> str:
    """ "g1, g2, g3, g4, g5 and 12 more": at most ``most`` of ``ids`` named, the rest counted."""
    return ", ".join(ids[:most]) + (f" and {len(ids) - most} more" if len(ids) > most else "")


def _came_and_went(before: Mapping[str, Any], now: Mapping[str, Any]) -> str:
    """ ": g3 came; g1 went" for the IDs in one and not the other, each _named ("" for none)."""
    changes = ((now.keys() - before.keys(), "came"), (before.keys() - now.keys(), "went"))
    parts = [f"{_named(_natural_sorted(list(ids)))} {what}" for ids, what in changes if ids]
    return f": {'; '.join(parts)}" if parts else ""


def _sorted_by_numbers(ids: list[str]) -> list[str] | None:
    """_natural_sorted for IDs that differ only in their numbers, the usual case ("g<n>", or
    "g<n>::<m>" with replicas): the same texts around the same count of numbers. Else None.

    Natural order is then the order of the IDs' tuples of numbers, and each tuple becomes one int,
    each number a digit in base (largest + 1): sorting 50,000 ints takes milliseconds, sorting 50,000
    keys of texts and numbers several times that. The numbers are found in one regex pass over the
    joined IDs, not one per ID (50,000 small lists would also keep the garbage collector busy)."""
    joined = "\x00".join(ids)
    if joined.count("\x00") != len(ids) - 1:
        return None  # an ID holds the separator
    texts = _DIGIT_RUN.split(ids[0])[::2]  # "g12::3" -> ["g", "::", ""]
    shape = "[0-9]+".join(map(re.escape, texts))
    if not re.fullmatch(f"(?:{shape}\x00)*+{shape}", joined):
        return None  # their texts differ
    runs = len(texts) - 1
    numbers = list(map(int, _DIGIT_RUN.findall(joined)))
    keys = numbers[0::runs] if runs else [0] * len(ids)
    for run in range(1, runs):
        column = numbers[run::runs]
        base = max(column) + 1
        keys = [key * base + number for key, number in zip(keys, column, strict=True)]
    by_key = dict(zip(keys, ids, strict=True))
    if len(by_key) != len(ids):
        return None  # equal numbers written differently ("g01", "g1"): the strings decide
    return [by_key[key] for key in sorted(by_key)]


def directory_mistake(directory: str, mode: int | None) -> str | None:
    """Why a source's ``directory`` will never give devices, and what to write instead, when it names
    a device itself (/dev/fuse) or a glob of them (/dev/ttyUSB*), as generic-device-plugin's `path`
    does; ``mode`` is what is at the path (its st_mode; None: nothing). None for a directory, or for
    a path that is simply not there (yet): hardware not plugged in."""
    parent, name = os.path.split(directory)
    instead = f"write directory: {parent} and pattern: {_as_written(name)}"
    if mode is None:
        if not re.search(r"[*?[]", name):
            return None
        return f"{directory} does not exist, and a directory is not a glob: for the entries it matches, {instead}"
    if stat.S_ISDIR(mode):
        return None
    kinds = {stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device", stat.S_IFREG: "a file"}
    kinds |= {stat.S_IFSOCK: "a socket", stat.S_IFIFO: "a FIFO"}
    return (
        f"{directory} is {kinds.get(stat.S_IFMT(mode), 'a file')}, not a directory of devices: to offer it, {instead}"
    )


@dataclass(frozen=True)
class Scan:
    """What scanning a resource's directory found."""

    devices: tuple[DeviceEntry, ...]  #: in natural order
    skipped: tuple[tuple[str, str], ...]  #: (entry name, why it is not a device), for the log
    followed: frozenset[str] = frozenset()  #: symlink targets: their coming and going changes health
    problem: str = ""  #: why the directory itself could not be read ("" if it could, or is just missing)
    #: it could not be read for want of a resource (_EXHAUSTED, EIO): what it holds is not known
    unknown: bool = False


#: The errors of a call that failed for want of descriptors or memory: what it would have found is not known.
_EXHAUSTED = (errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS)


def _innermost(error: BaseException) -> BaseException:
    """The error inside the one-member exception groups that anyio and trio wrap around it."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error


def _describe(error: BaseException, silent: str = "") -> str:
    """One line for an error, for a log line or an RPCError message: for a system call, the system's
    words ("Permission denied"), not Python's class name and errno, which tell a user nothing more.
    ``silent``: what to say of an error that says nothing (else its class name, for a developer)."""
    error = _innermost(error)
    if isinstance(error, OSError) and error.strerror:  # out of a resource: named as the kernel names it too
        return f"{errno.errorcode[error.errno]}: {error.strerror}" if error.errno in _EXHAUSTED else error.strerror
    lines = str(error).strip().splitlines()
    return lines[0] if lines else silent or type(error).__name__


# CDI device names begin and end with a letter or digit; ":" may stand between (ValidateDeviceName
# in container-device-interface pkg/parser/parser.go).
_CDI_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._:-]*[A-Za-z0-9])?")


def scan_directory(resource: ResourceConfig, sysfs_root: str = "/sys", dev_root: str = "/dev") -> Scan:
    """The resource's devices, each with its health, NUMA node and host paths: the entries of its
    directories (``directory`` or every ``match``) and its USB devices' nodes, made into devices.

    A missing directory (or a file where the directory should be) has no devices: the kubelet then
    gets an empty list, which drops the resource's capacity to zero at once."""
    roots = host_path_roots(resource, dev_root)
    scans = [scan_source(resource, source, roots, sysfs_root) for source in resource.sources]
    if resource.usb:
        scans.append(scan_usb(resource, roots, sysfs_root, dev_root))
    entries = [entry for scan in scans for entry in scan.devices]
    skipped = sorted(skip for scan in scans for skip in scan.skipped)
    problem = "; ".join(scan.problem for scan in scans if scan.problem)
    devices = group_entries(entries)
    return Scan(tuple(devices), tuple(skipped), frozenset(p for d in entries for p in d.followed), problem)


def scan_source(resource: ResourceConfig, source: Source, roots: list[str], sysfs_root: str) -> Scan:
    """The entries of one source's directory, each examined (not yet made into devices)."""
    try:
        names = os.listdir(source.directory)
    except (FileNotFoundError, NotADirectoryError):
        return Scan((), ())
    except OSError as error:  # e.g. no permission to list it: no devices, and a reason for the log
        unknown = error.errno in (*_EXHAUSTED, errno.EIO)  # not "empty": the devices may all be there
        return Scan((), (), problem=f"cannot read {source.directory}: {_describe(error)}", unknown=unknown)
    entries, skipped = [], []
    for name in names:
        found = examine_entry(resource, source, name, roots, sysfs_root)
        if isinstance(found, DeviceEntry):
            entries.append(found)
        elif found is not None:
            skipped.append((name, found))
    return Scan(tuple(entries), tuple(skipped), frozenset(p for d in entries for p in d.followed))


def scan_usb(resource: ResourceConfig, roots: list[str], sysfs_root: str, dev_root: str) -> Scan:
    """The nodes of the resource's USB devices, each examined as an entry whose ID is its device's.
    A node not in /dev yet is left out until it is (udev may still be making it)."""
    entries, skipped = [], []
    for usb in find_usb_devices(resource.usb, sysfs_root, dev_root):
        if why := _id_problem(resource, usb.id):
            skipped.append((usb.port, why))
            continue
        for node in usb.members:
            found = examine_path(resource, usb.id, node, roots, sysfs_root)
            if isinstance(found, DeviceEntry):
                # {sysfs} is the USB device's directory, whose idVendor, serial and the like each node shares
                directory = os.path.join(sysfs_root, "bus", "usb", "devices", usb.port)
                entries.append(dataclasses.replace(found, usb=usb, sysfs=directory))
            elif found is not None:
                skipped.append((node, found))
    return Scan(tuple(entries), tuple(skipped))


def group_entries(entries: Iterable[DeviceEntry]) -> list[DeviceEntry]:
    """The devices the entries make, in natural order of their IDs: entries with the same ID are
    one device (merge_entries)."""
    by_id: dict[str, list[DeviceEntry]] = {}
    for entry in entries:
        by_id.setdefault(entry.id, []).append(entry)
    return [merge_entries(by_id[device_id]) for device_id in _natural_sorted(list(by_id))]


def merge_entries(entries: list[DeviceEntry]) -> DeviceEntry:
    """One device made of entries with the same ID (one entry is that device itself).

    It has every member's DeviceSpecs and mounts, and is unhealthy while any member is, with the
    first such member's problem: a GPU without its render node, a serial adapter with one port of
    two, is not a device a container can use. Its path and NUMA node are its first member's
    (natural order of paths); each member keeps its own."""
    if len(entries) == 1:
        return entries[0]
    members = sorted({entry.path: entry for entry in entries}.values(), key=lambda entry: _natural_key(entry.path))
    if len(members) == 1:
        return members[0]
    first = members[0]
    problems = [member.problem for member in members if member.health != HEALTHY]
    return DeviceEntry(
        first.id,
        first.path,
        any(member.is_device_node for member in members),
        UNHEALTHY if problems else HEALTHY,
        problems[0] if problems else "",
        next((member.numa_node for member in members if member.numa_node is not None), None),
        tuple(spec for member in members for spec in member.device_specs),
        tuple(mount for member in members for mount in member.mounts),
        tuple(dict.fromkeys(path for member in members for path in member.followed)),
        tuple(members),
        next((member.pci for member in members if member.pci is not None), None),
        next((member.usb for member in members if member.usb is not None), None),
        next((member.sysfs for member in members if member.sysfs), ""),
    )


def shared_nodes(offered: Iterable[tuple[ResourceConfig, Iterable[DeviceEntry]]]) -> list[str]:
    """A line for each file that two resources offer (where symlinks lead: /dev/serial/by-id/... is
    /dev/ttyUSB0), unless one lists the other in ``shared_with``.

    Neither the kubelet nor the scheduler knows that two resource names (or a device-plugin resource
    and a DRA pool) stand for one device node: each counts its own, so two pods can be given one
    serial port at once. A migrated generic-device-plugin set-up does it easily: a ``ttyUSB*`` glob
    beside a ``usb: 1a86:7523`` resource both find /dev/ttyUSB0."""
    resources: dict[str, ResourceConfig] = {}
    holders: dict[str, dict[str, str]] = {}  # file -> resource name -> the ID of its device there
    for resource, devices in offered:
        resources[resource.name] = resource
        for device in devices:
            for member in device.members or (device,):
                target = member.followed[-1] if member.followed else member.path
                holders.setdefault(target, {}).setdefault(resource.name, device.id)
    lines = []
    for target, by in sorted(holders.items()):
        for first, second in itertools.combinations(by, 2):  # in the configuration's order
            if second in resources[first].shared_with or first in resources[second].shared_with:
                continue
            lines.append(
                f"{target} is offered by both {first} (device {by[first]}) and {second} (device {by[second]}): "
                f"two pods could be given it at once; leave it out of one, or, if they are meant to share it, "
                f"list {second} in shared_with of {first}"
            )
    return lines


def examine_again(
    resource: ResourceConfig,
    device: DeviceEntry,
    roots: list[str],
    sysfs_root: str,
    directories: dict[str, str] | None = None,
) -> DeviceEntry | str | None:
    """A device as its files are now: each member examined again at the path it was found at
    (None: every one is gone; a string: why one may not be used). ``directories``: see
    examine_path. Its topology is the member's as the scan's thread read it (``known``)."""
    entries = []
    for member in device.members or (device,):
        found = examine_path(resource, device.id, member.path, roots, sysfs_root, directories=directories, known=member)
        if isinstance(found, str):
            return found
        if found is not None:
            entries.append(found)
    return merge_entries(entries) if entries else None


def host_path_roots(
    resource: ResourceConfig, dev_root: str = "/dev", directories: dict[str, str] | None = None
) -> list[str]:
    """Where the resource's host paths may lie, symlinks resolved: its directories, what it allows,
    and /dev (``dev_root``) when a directory is in /dev or the devices are USB devices.

    /dev is not allowed implicitly to a directory elsewhere: whoever may write that directory could
    link an entry to any disk (g0 -> /dev/vda) and have it handed to a container read-write. In
    /dev only root and udev write, and their links (by-id, by-path) lead to the device nodes."""
    # Each path resolved once (realpath is an lstat() per component): the directories' resolved
    # forms serve as roots, for the /dev test, and (``directories``, filled in here) for the
    # entries in them, when examine_path resolves their host paths.
    resolved = [_resolved_directory(source.directory, directories) for source in resource.sources]
    roots = [*resolved, *(os.path.realpath(root) for root in resource.allowed_host_paths)]
    resolved_dev = os.path.realpath(dev_root)
    if resource.usb or any(_is_under(directory, [resolved_dev]) for directory in resolved):
        roots.append(resolved_dev)
    return list(dict.fromkeys(roots))


def examine_entry(
    resource: ResourceConfig, source: Source, name: str, roots: list[str], sysfs_root: str
) -> DeviceEntry | str | None:
    """One entry of a source's directory: its DeviceEntry, why it is skipped, or None when it is
    not a candidate at all (hidden, not matching the pattern, or not there)."""
    if name.startswith(".") or not fnmatch.fnmatchcase(name, source.pattern):
        return None
    path = os.path.join(source.directory, name)
    try:
        found_status = os.lstat(path)
    except OSError:
        return None  # gone already: it leaves the list
    device_id = name
    if resource.id_pattern is not None:
        found = resource.id_pattern.fullmatch(name)
        if found is None or not found["id"]:
            return f"id_pattern {_as_written(resource.id_pattern.pattern)} finds no ID in the name"
        device_id = found["id"]
    if why := _id_problem(resource, device_id):
        return why if device_id == name else f"its ID {device_id!r}: {why}"
    return examine_path(resource, device_id, path, roots, sysfs_root, found_status)


def _id_problem(resource: ResourceConfig, device_id: str) -> str:
    """Why the kubelet (or CDI) would not take ``device_id`` as a device's ID, or ""."""
    if not _DEVICE_ID.fullmatch(device_id):
        return "a device ID must be 1 to 63 of A-Z a-z 0-9 . _ - :, without '::'"
    if resource.cdi is not None and not _CDI_NAME.fullmatch(device_id):
        return "a CDI device name must begin and end with a letter or digit"
    return ""


def examine_path(
    resource: ResourceConfig,
    device_id: str,
    path: str,
    roots: list[str],
    sysfs_root: str,
    link_status: os.stat_result | None = None,
    *,
    directories: dict[str, str] | None = None,
    known: DeviceEntry | None = None,
) -> DeviceEntry | str | None:
    """The file at ``path`` as the entry ``device_id`` of the resource: its DeviceEntry, why it is
    skipped (a host path outside ``roots``), or None when it is not there. ``link_status``: its
    lstat(), if the caller has it already. ``directories``: directories resolved already, by
    their path (filled in as more are met), for a caller that examines several entries at one
    moment (an Allocate): an entry that is no symlink is its directory's resolved path and its
    name, which is what realpath() finds, one lstat() per component, for each entry anew.
    ``known``: the entry as scanned (for Allocate, on the event loop, which a hung sysfs file would
    freeze): its NUMA node and PCI address are taken, not read, for the same device number only."""
    try:
        is_link = stat.S_ISLNK((link_status or os.lstat(path)).st_mode)
    except OSError:
        return None  # gone already: it leaves the list
    target = None
    if directories is not None and not is_link:
        head, name = os.path.split(path)
        if head and name not in ("", ".", ".."):  # (a configured path is absolute and normalized)
            target = os.path.join(_resolved_directory(head, directories), name)
    unreachable: OSError | None = None
    status: os.stat_result | None = None
    try:
        status = os.stat(path)
        mode, rdev = status.st_mode, status.st_rdev
    except FileNotFoundError as error:
        if not is_link:
            return None  # deleted since lstat(): gone, not unhealthy
        mode = rdev = 0  # a dangling symlink: still a device (unhealthy), never a device node
        unreachable = error
    except OSError as error:
        mode = rdev = 0  # cannot even stat it: a device, unhealthy
        unreachable = error
    if stat.S_ISDIR(mode):
        # /dev/dri without a pattern has by-path beside card1 and renderD128: offered, a pod would
        # get "DRI_DEVICES=by-path" and no GPU. A directory is where devices are, never one.
        return _directory_entry(path)
    is_node = stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
    specs, mounts = _host_paths(resource, device_id, path, is_node, status, target)
    outside = [p for p in [*(s.host_path for s in specs), *(m.host_path for m in mounts)] if not _is_under(p, roots)]
    if outside:
        return f"host path {outside[0]} is outside {', '.join(roots)}: add its directory to allowed_host_paths"
    if stat.S_ISBLK(mode) and not resource.allow_mounted and (mounted := _mounted_at(rdev, sysfs_root)):
        # A pod that writes to it would corrupt the filesystem under the node's feet.
        number = f"{os.major(rdev)}:{os.minor(rdev)}"
        return f"block device {number} holds the filesystem mounted at {mounted}: set allow_mounted: true to offer it"
    problem = _health_problem(path, unreachable, _access_needed(specs, is_node), is_node)
    if known is not None:  # (Allocate)
        numa_node, pci = (known.numa_node, known.pci) if is_node and known.rdev == rdev else (None, None)
    else:
        numa_node = _numa_node(sysfs_root, mode, rdev) if is_node else None
        pci = _pci_address(sysfs_root, mode, rdev) if is_node and resource.dra else None  # slices only
        if numa_node is None and pci is not None:
            # The node's sysfs device is a child of the PCI function (virtio-blk's virtio1, a
            # virtio-console port's virtio2), with no numa_node of its own: the function's is the
            # device's, and the one deviceattribute reads for the standard numaNode of a PCI device.
            numa_node = _read_numa_node(os.path.join(sysfs_root, "bus", "pci", "devices", pci.bus_id, "numa_node"))
    health = UNHEALTHY if problem else HEALTHY
    followed = _symlink_hops(path) if is_link else ()
    # The node's link in sysfs (dev/char/MAJ:MIN leads to its device's directory): only a path, looked
    # at when an attribute's file is read through it (read_declared_values), never here; and only for
    # a resource that declares values (examine_again runs in Allocate, which needs none of it).
    sysfs = _sysfs_link(sysfs_root, mode, rdev) if is_node and (resource.attributes or resource.capacity) else ""
    return DeviceEntry(
        device_id, path, is_node, health, problem, numa_node, specs, mounts, followed, pci=pci, sysfs=sysfs, rdev=rdev
    )


def _sysfs_link(sysfs_root: str, mode: int, rdev: int) -> str:
    """Where sysfs has a device node's directory: dev/char/MAJ:MIN (or dev/block/), a link to it."""
    kind = "char" if stat.S_ISCHR(mode) else "block"
    return os.path.join(sysfs_root, "dev", kind, f"{os.major(rdev)}:{os.minor(rdev)}")


def _resolved_directory(directory: str, directories: dict[str, str] | None) -> str:
    """realpath(directory), looked up in ``directories`` or added to it (None: resolved, not kept)."""
    if directories is None:
        return os.path.realpath(directory)
    if (resolved := directories.get(directory)) is None:
        resolved = directories[directory] = os.path.realpath(directory)
    return resolved


def _directory_entry(path: str) -> str:
    """Why a directory (or a symlink to one) found among a resource's entries is skipped."""
    return (
        f"a directory, not a device: for the devices in it, write directory: {path} (or a match entry for it); "
        "a pattern that leaves it out silences this line"
    )


def _read_text(path: str) -> str | None:
    """A text file's content, or None if it cannot be read now. A byte that is not UTF-8 is kept as a
    lone surrogate (surrogateescape), for YAML's reader to refuse where it stands (_yaml_problem)."""
    with contextlib.suppress(OSError):
        return _file_text(path)
    return None


def _mounted_at(rdev: int, sysfs_root: str, mountinfo_path: str = "/proc/self/mountinfo") -> str:
    """Where a filesystem on block device ``rdev`` is mounted, or "": the device itself, one of its
    partitions, or a device built on it (device-mapper, LVM, md: its holders in sysfs). The mount
    table's third field is the device number of each mount's filesystem. Allocate asks this on the
    event loop, and may: the kernel prints the mount table from memory (a hung NFS or FUSE mount's
    line too, never asking its server), and dev, partition and holders are the driver core's own."""
    mounted: dict[str, str] = {}  # device number -> the first mount point of its filesystem
    for line in (_read_text(mountinfo_path) or "").splitlines():
        fields = line.split()
        if len(fields) > 4:
            mounted.setdefault(fields[2], fields[4])
    todo, seen = [f"{os.major(rdev)}:{os.minor(rdev)}"], set()
    while todo:
        number = todo.pop()
        if number in mounted:
            return mounted[number]
        if number in seen:
            continue
        seen.add(number)
        block = os.path.join(sysfs_root, "dev", "block", number)
        with contextlib.suppress(OSError):
            for entry in os.scandir(block):  # its partitions: directories with a "partition" file
                if os.path.exists(os.path.join(entry.path, "partition")):
                    todo.append(_sysfs_text(os.path.join(entry.path, "dev")).strip())
        with contextlib.suppress(OSError):
            for holder in os.listdir(os.path.join(block, "holders")):
                todo.append(_sysfs_text(os.path.join(block, "holders", holder, "dev")).strip())
    return ""


def _host_paths(
    resource: ResourceConfig,
    device_id: str,
    path: str,
    is_node: bool,
    status: os.stat_result | None = None,
    target: str | None = None,
) -> tuple[tuple[DeviceSpecTemplate, ...], tuple[MountTemplate, ...]]:
    """An entry's DeviceSpecs and mounts, host paths filled in and resolved, container paths
    filled in but for {index}, which waits for an allocation. With ``cdi``, each DeviceSpec also
    has its host file's mode and owner, which the CDI spec needs (the kubelet's DeviceSpecs do
    not): ``status`` (the entry's stat(), of the file a symlink leads to) for the entry itself,
    one stat() more for a host path elsewhere.

    The runtime opens a host path when it creates the container, and again at every restart of it,
    from the allocation the kubelet stored: a symlink re-pointed in between would lead those to
    another file than the one checked here. So the runtime gets the file itself (/dev/ttyUSB0),
    and the stable name (the by-id link) is where the container finds it.

    Without device_specs, a device node passes through at its own path. Without mounts, an
    entry that is no device node gets nothing but the env var; in a device of several entries
    (id_pattern), it is mounted read-only at its own path, like a node is passed through.
    ``target``: the entry's realpath(), if the caller has it."""
    default_mount = not resource.mounts and resource.id_pattern is not None and not is_node
    if resource.device_specs is None and not resource.mounts and not is_node and not default_mount:
        return (), ()  # the usual file that is not a node: nothing to fill in (and a scan of 50,000 is quicker)
    target = target if target is not None else os.path.realpath(path)
    fields = {"id": device_id, "path": path, "name": os.path.basename(path), "target": target}
    # The filled-in values go into a template again: their braces must stay text.
    literal = {key: value.replace("{", "{{").replace("}", "}}") for key, value in fields.items()}

    def fill(host_path: str, container_path: str) -> tuple[str, str]:
        host = host_path.format(**fields)
        # "{path}" (the usual template) is the entry itself, resolved already: one realpath less.
        resolved = fields["target"] if host == path else os.path.realpath(host)
        return resolved, container_path.format(**literal, index="{index}")

    specs: tuple[DeviceSpecTemplate, ...]
    if resource.device_specs is None:
        specs = ()
        if is_node and status is not None and resource.cdi is not None:  # (spelled out: the scan's hot path)
            host_mode = (stat.S_IMODE(status.st_mode), status.st_uid, status.st_gid)
            specs = (DeviceSpecTemplate(fields["target"], literal["path"], "rw", host_mode),)
        elif is_node:
            specs = (DeviceSpecTemplate(fields["target"], literal["path"], "rw"),)
    else:
        filled = [(*fill(s.host_path, s.container_path), s.permissions) for s in resource.device_specs]
        specs = tuple(
            DeviceSpecTemplate(host, container, permissions, _host_mode(status if host == fields["target"] else host))
            if resource.cdi is not None
            else DeviceSpecTemplate(host, container, permissions)
            for host, container, permissions in filled
        )
    mounts: tuple[MountTemplate, ...]
    if default_mount:
        mounts = (MountTemplate(fields["target"], literal["path"], True),)
    else:
        mounts = tuple(MountTemplate(*fill(m.host_path, m.container_path), m.read_only) for m in resource.mounts)
    return specs, mounts


def _host_mode(status: os.stat_result | str | None) -> tuple[int, int, int] | None:
    """A file's mode without its type bits (what containerd copies of a DeviceSpec's host node),
    uid and gid; from its stat() or its path. None when it cannot be stat'ed."""
    if isinstance(status, str):
        try:
            status = os.stat(status)
        except OSError:
            return None
    return None if status is None else (stat.S_IMODE(status.st_mode), status.st_uid, status.st_gid)


def _symlink_hops(path: str) -> tuple[str, ...]:
    """Every path a symlink leads through (by-id -> by-path -> the node), and where it ends up:
    udev replaces the links in between when a device is unplugged."""
    hops, current = [], path
    for _ in range(40):  # the kernel's own limit on links followed
        try:
            link = os.readlink(current)
        except OSError:
            break
        current = os.path.normpath(os.path.join(os.path.dirname(current), link))
        hops.append(current)
    return tuple(dict.fromkeys([*hops, os.path.realpath(path)]))


def _access_needed(specs: Iterable[DeviceSpecTemplate], is_node: bool) -> int:
    """What the container will do with the device: read and write a device node, read anything else."""
    letters = set("".join(spec.permissions for spec in specs)) if specs else set("rw" if is_node else "r")
    return (os.R_OK if "r" in letters else 0) | (os.W_OK if "w" in letters else 0)


def _health_problem(path: str, unreachable: OSError | None, access: int, is_node: bool = False) -> str:
    """Why the device at ``path`` cannot be used as configured, or "" if it can.

    The check is access(): what this process may do with the file, by its mode, owner and this
    process's capabilities (EACCES). For a device node the kernel then asks one more question, of
    the *caller's* device cgroup (security/device_cgroup.c, devcgroup_inode_permission), and says
    EPERM: an unprivileged container may open only the runtime's default nodes (null, zero,
    random, tty, ...) and those its own spec lists. The plugin's container lists none of the devices
    it offers, and the consumer's will, because the runtime adds each DeviceSpec to the consumer's
    cgroup. So EPERM on a node is a fact about the plugin's cgroup, not about the device: the node
    is there, and its mode let us through, which is all the plugin can know from outside."""
    if isinstance(unreachable, FileNotFoundError):
        if os.path.islink(path):
            return f"{path} is a symlink to {os.readlink(path)}, which does not exist"
        return f"{path} is gone"
    if unreachable is not None:
        return f"cannot stat {path}: {unreachable.strerror}"
    if not os.access(path, access or os.F_OK):
        refused = _access_errno(path, access)
        if is_node and refused == errno.EPERM:
            return ""  # the mode allowed it; only this process's own device cgroup refused
        wanted = {os.R_OK: "reading", os.W_OK: "writing", os.R_OK | os.W_OK: "reading and writing"}
        problem = f"this process cannot open {path} for {wanted.get(access, 'use')}"
        # What to change, as check-config says it: the mode and owner, for the user this process is.
        uid = os.geteuid()
        who = "root without capabilities" if uid == 0 else f"uid {uid}"
        if why := _mode_refusal(path, access, uid, {os.getegid(), *os.getgroups()}, who):
            return f"{problem}: {why}: fix the mode or owner on the host (a udev rule, for nodes that come and go)"
        return f"{problem}: {os.strerror(refused)}" if refused else problem  # not the mode: EROFS, an ACL
    return ""


def pod_mode_problem(path: str, access: int) -> str:
    """Why the shipped DaemonSets' plugin, uid 0 and gid 0 with every capability dropped, would be
    refused ``access`` on ``path`` by the file's mode and owner, or "".

    Without CAP_DAC_OVERRIDE, root is a user like any other: the kernel takes the owner's bits if it
    owns the file, else the group's if its group does, else the others' (never a union of them).
    `check-config` run as root on the node keeps that capability, and would call healthy what the
    pod calls unhealthy. POSIX ACLs are not looked at."""
    return _mode_refusal(path, access, 0, {0}, "root without capabilities")


def _mode_refusal(path: str, access: int, uid: int, gids: Iterable[int], who: str) -> str:
    """Why the mode and owner of ``path`` refuse ``access`` to ``uid`` in the groups ``gids``
    (named ``who`` in the line), capabilities aside, or "": the kernel takes the owner's bits if
    the user owns the file, else the group's if one of its groups does, else the others'."""
    try:
        status = os.stat(path)
    except OSError:
        return ""
    shift = 6 if status.st_uid == uid else 3 if status.st_gid in set(gids) else 0
    need = (4 if access & os.R_OK else 0) | (2 if access & os.W_OK else 0)
    if not need or (status.st_mode >> shift) & need == need:
        return ""
    wanted = {4: "reading", 2: "writing", 6: "reading and writing"}[need]
    return f"mode {stat.S_IMODE(status.st_mode):04o} and owner {status.st_uid}:{status.st_gid} refuse {wanted} to {who}"


def _access_errno(path: str, access: int) -> int:
    """Why access() refuses: its errno (0 if it does not). os.access() answers only yes or no."""
    return 0 if _libc().access(os.fsencode(path), access) == 0 else ctypes.get_errno()


@functools.cache
def _libc() -> ctypes.CDLL:
    """The C library, loaded when first asked for (most processes never need it)."""
    return ctypes.CDLL(None, use_errno=True)


def _numa_node(sysfs_root: str, mode: int, rdev: int) -> int | None:
    """The NUMA node of a device node from sysfs; None when the kernel gives none (-1) or no file."""
    return _read_numa_node(os.path.join(_sysfs_link(sysfs_root, mode, rdev), "device", "numa_node"))


def _read_numa_node(path: str) -> int | None:
    """A sysfs numa_node file; None when the kernel gives none (-1) or there is no file. A PCI
    function's is bus/pci/devices/<bus ID>/numa_node (GetNUMANodeAttributeByPCIBusID in
    kubernetes/kubernetes staging/src/k8s.io/dynamic-resource-allocation/deviceattribute/numa_linux.go)."""
    try:
        with open(path, encoding="ascii") as file:
            node = int(file.read().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


# A PCI function's directory name in sysfs: domain, bus, device and function in hex ("0000:03:00.0"),
# the extended BDF notation of resource.kubernetes.io/pciBusID (k8s.io/dynamic-resource-allocation
# deviceattribute/pci.go).
_PCI_BUS_ID = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-9a-f]")


def _pci_address(sysfs_root: str, mode: int, rdev: int) -> PciAddress | None:
    """The PCI device a device node belongs to, from sysfs: dev/char/MAJ:MIN/device leads into
    devices/, where the device (a GPU's function, or a class device under it, as nvme0 is) sits
    under its PCI function's directory, and that under its root complex: devices/pci0000:00/
    0000:00:01.0/0000:03:00.0. The nearest directory above whose subsystem is pci is the function;
    one whose subsystem is usb first means the node is a USB device's, not a PCI device's (the
    host controller is PCI, the adapter is not). The root is the first directory under devices/,
    as deviceattribute/pci.go reads it. None for anything else."""
    devices = os.path.realpath(os.path.join(sysfs_root, "devices"))
    try:
        here = os.path.realpath(os.path.join(_sysfs_link(sysfs_root, mode, rdev), "device"))
    except OSError:
        return None
    while here.startswith(devices + os.sep):
        try:
            subsystem = os.path.basename(os.readlink(os.path.join(here, "subsystem")))
        except OSError:
            subsystem = ""
        if subsystem == "usb":
            return None
        if subsystem == "pci" and _PCI_BUS_ID.fullmatch(os.path.basename(here)):
            root = os.path.relpath(here, devices).split(os.sep)[0]
            return PciAddress(os.path.basename(here), root) if root.startswith("pci") else None
        here = os.path.dirname(here)
    return None


# USB devices by vendor and product. sysfs lists every USB device and interface in bus/usb/devices,
# as a symlink named by port path ("1-1.4": bus 1, root port 1, then port 4 of the hub there;
# "usb1" for the root hub, a device too) or by interface ("1-1.4:1.0"). It leads into devices/,
# where a device's directory holds its interfaces, they the class devices (tty, hidraw, video4linux,
# input) whose uevent names a node in /dev, and a hub's directory its children's directories too.


@dataclass(frozen=True)
class UsbDevice:
    """A USB device a selector matched, and the device nodes a container needs to use it."""

    id: str  #: its serial when that is a valid device ID and unique among the matches; else its port path
    port: str  #: the port path ("1-1.4"), its name in bus/usb/devices: the same while it stays plugged there
    vendor: str
    product: str
    serial: str | None  #: None: the device has none (many cheap ones)
    members: tuple[str, ...]  #: its own node (bus/usb/BBB/DDD, what libusb opens) first, then its interfaces'


def find_usb_devices(
    selectors: Iterable[UsbSelector], sysfs_root: str = "/sys", dev_root: str = "/dev"
) -> tuple[UsbDevice, ...]:
    """The USB devices that a selector matches, in natural order of their IDs.

    A device that cannot be read whole is left out, and a node that cannot be read is: either is
    being unplugged, and the next scan finds it gone (or back)."""
    selectors = tuple(selectors)
    links = os.path.join(sysfs_root, "bus", "usb", "devices")
    try:
        names = os.listdir(links)
    except OSError:
        return ()  # no USB at all
    found = []
    for port in names:
        if ":" in port:
            continue  # an interface: read with its device
        try:
            device = _usb_device(os.path.realpath(os.path.join(links, port)), port, selectors, dev_root)
        except OSError:
            continue
        if device is not None:
            found.append(device)
    # A serial names a device wherever it is plugged in, but cheap ones share theirs (a batch of
    # adapters all "0001") or have one that is no valid ID: then its port path is its ID. A serial
    # that is a matched device's port path is not used either, so that no two IDs are the same.
    counts = collections.Counter(device.serial for device in found)
    ports = {device.port for device in found}
    found = [
        dataclasses.replace(device, id=device.serial)
        if device.serial is not None
        and counts[device.serial] == 1
        and device.serial not in ports
        and _DEVICE_ID.fullmatch(device.serial)
        else device
        for device in found
    ]
    return tuple(sorted(found, key=lambda device: _natural_key(device.id)))


def _usb_device(directory: str, port: str, selectors: tuple[UsbSelector, ...], dev_root: str) -> UsbDevice | None:
    """The USB device in a sysfs directory (its ID the port path), or None if no selector matches it.

    Raises OSError when the device cannot be read: a device being unplugged vanishes file by file."""
    vendor = _sysfs_text(os.path.join(directory, "idVendor")).strip().lower()
    product = _sysfs_text(os.path.join(directory, "idProduct")).strip().lower()
    try:
        serial: str | None = _sysfs_text(os.path.join(directory, "serial")).removesuffix("\n")
    except FileNotFoundError:
        serial = None  # the device reports none
    if not any(
        (s.vendor, s.product) == (vendor, product) and (s.serial is None or s.serial == serial) for s in selectors
    ):
        return None
    own = _uevent_devname(os.path.join(directory, "uevent"))
    # Interfaces only (names with ':'): a hub's children sit beside them (1-1/1-1.4), not in them,
    # and the rest (power, ep_81) has no node. Symlinks are never followed: sysfs links up
    # (subsystem, a class device's device) and sideways (port, a hub port's device), so a walk
    # following them would loop, or collect other devices' nodes.
    with os.scandir(directory) as entries:
        interfaces = [entry.path for entry in entries if ":" in entry.name and entry.is_dir(follow_symlinks=False)]
    nodes = set()
    for interface in interfaces:
        for parent, _, files in os.walk(interface, followlinks=False):  # an unreadable directory is skipped
            if "uevent" in files:
                with contextlib.suppress(OSError):
                    if name := _uevent_devname(os.path.join(parent, "uevent")):
                        nodes.add(os.path.join(dev_root, name))
    members = [os.path.join(dev_root, own)] if own else []
    members += sorted(nodes, key=_natural_key)
    return UsbDevice(port, port, vendor, product, serial, tuple(dict.fromkeys(members)))


def _sysfs_text(path: str) -> str:
    """A sysfs file's text; bytes that are no UTF-8 kept as they are (surrogate escapes), never an error."""
    with open(path, encoding="utf-8", errors="surrogateescape") as file:
        return file.read()


def _uevent_devname(path: str) -> str | None:
    """The DEVNAME of a uevent file: the path of its node under /dev, or None when it has no node."""
    for line in _sysfs_text(path).splitlines():
        key, _, value = line.partition("=")
        if key == "DEVNAME" and value:
            return value
    return None


# 4c. The answers: ListAndWatch, Allocate, GetPreferredAllocation, CDI specs ---------------------------
def list_and_watch_response(resource: ResourceConfig, devices: Iterable[DeviceEntry]) -> Any:
    """The ListAndWatch message for a device set: every replica of every device, with health and topology."""
    response = v1beta1.ListAndWatchResponse()
    for device in devices:
        topology = None
        if device.numa_node is not None:
            topology = v1beta1.TopologyInfo(nodes=[v1beta1.NUMANode(ID=device.numa_node)])
        for kubelet_id in resource.replica_ids(device.id):
            response.devices.add(ID=kubelet_id, health=device.health, topology=topology)
    return response


def device_plugin_options(resource: ResourceConfig) -> Any:
    """What gopherplug implements: a preferred allocation always, PreStartContainer when configured."""
    return v1beta1.DevicePluginOptions(
        pre_start_required=bool(resource.pre_start), get_preferred_allocation_available=True
    )


def allocated_devices(
    resource: ResourceConfig, devices: Mapping[str, DeviceEntry], ids: Iterable[str]
) -> list[DeviceEntry]:
    """The devices behind the kubelet's IDs, each once, in the order of the IDs.

    Raises RPCError(INVALID_ARGUMENT) naming the IDs that are no current device (or replica), and
    RPCError(FAILED_PRECONDITION) for an unhealthy device: the kubelet then fails the pod with
    UnexpectedAdmissionError instead of starting it without a working device."""
    ids = list(ids)
    underlying = {kubelet_id: resource.underlying_id(kubelet_id) for kubelet_id in ids}
    unknown = sorted({i for i, device_id in underlying.items() if device_id not in devices}, key=_natural_key)
    if unknown:
        # _named: grpc-message is an HTTP/2 header, and purerpc's HPACK encoder is quadratic in its length.
        raise RPCError(StatusCode.INVALID_ARGUMENT, f"unknown {resource.name} device IDs: {_named(unknown)}")
    chosen = [devices[device_id] for device_id in dict.fromkeys(underlying.values()) if device_id is not None]
    for device in chosen:
        if device.health != HEALTHY:
            raise RPCError(StatusCode.FAILED_PRECONDITION, f"{resource.name} device {device.id}: {device.problem}")
    return chosen


def allocate_response(resource: ResourceConfig, devices: Mapping[str, DeviceEntry], request: Any) -> Any:
    """Answer Allocate: per container request, what the container gets for its devices.

    The env var lists the devices (not replicas) in the kubelet's order; DeviceSpecs, mounts and
    annotations come from the templates, once per device, {index} being its position in that list;
    cdi_devices name the devices for a CDI-aware runtime."""
    return allocate_with_devices(resource, devices, request)[0]


def allocate_with_devices(
    resource: ResourceConfig, devices: Mapping[str, DeviceEntry], request: Any
) -> tuple[Any, list[list[DeviceEntry]]]:
    """allocate_response, and the devices behind each container's answer (for an embedder's hook)."""
    if not request.container_requests:
        raise RPCError(StatusCode.INVALID_ARGUMENT, "AllocateRequest has no container requests")
    response, allocated = v1beta1.AllocateResponse(), []
    for container in request.container_requests:
        chosen = allocated_devices(resource, devices, container.devices_ids)
        allocated.append(chosen)
        answer = response.container_responses.add()
        answer.envs[resource.env] = ",".join(device.id for device in chosen)
        specs: dict[str, Any] = {}
        mounts: dict[str, Any] = {}
        annotations: dict[str, list[str]] = {}
        for index, device in enumerate(chosen):
            fields = {"id": device.id, "path": device.path, "index": index}
            for spec in device.device_specs:
                inside = spec.container_path.format(**fields)
                node = v1beta1.DeviceSpec(host_path=spec.host_path, container_path=inside, permissions=spec.permissions)
                _add_once(specs, "device", node)
            for mount in device.mounts:
                inside = mount.container_path.format(**fields)
                bind = v1beta1.Mount(host_path=mount.host_path, container_path=inside, read_only=mount.read_only)
                _add_once(mounts, "mount", bind)
            for key, value in resource.annotations:
                values = annotations.setdefault(key.format(**fields), [])
                if (filled := value.format(**fields)) not in values:
                    values.append(filled)
        answer.devices.extend(specs.values())
        answer.mounts.extend(mounts.values())
        # A key without placeholders collects every device's value, comma-joined like the env var.
        answer.annotations.update({key: ",".join(values) for key, values in annotations.items()})
        if resource.cdi is not None:
            answer.cdi_devices.extend(v1beta1.CDIDevice(name=f"{resource.cdi.kind}={d.id}") for d in chosen)
    return response, allocated


def _add_once(added: dict[str, Any], what: str, item: Any) -> None:
    """Add a DeviceSpec or Mount by container path: the same one twice is one; a clash is an error."""
    earlier = added.setdefault(item.container_path, item)
    if earlier != item:
        raise RPCError(
            StatusCode.FAILED_PRECONDITION,
            f"two {what}s for container path {item.container_path}, from {earlier.host_path} and "
            f"{item.host_path}: put {{id}} or {{index}} in the container path",
        )


def preferred_allocation_response(
    resource: ResourceConfig, devices: Mapping[str, DeviceEntry], request: Any, *, order: _PreferredOrder | None = None
) -> Any:
    """Answer GetPreferredAllocation: the best ``allocation_size`` of the available IDs.

    The must-include IDs first (the kubelet has already given those to the pod's other containers);
    then, one at a time, the available ID that keeps the allocation on as few NUMA nodes as possible,
    then (packed) on replicas of devices already chosen or (spread) on the least used devices, then
    in natural order. Deterministic, and never an ID that was not offered. When the request cannot
    be met, the answer is short, and the kubelet falls back to its own choice.

    ``order``: a _PreferredOrder of this very ``resource`` and ``devices``, kept by the caller
    across requests (the service keeps one per device set): where it can answer, the answer costs
    what reading the request costs, not a sort of every offered ID. The answer is the same."""
    response = v1beta1.PreferredAllocationResponse()
    strict = None  # the request with its IDs as text, parsed again only if _pick needs it
    for number, container in enumerate(request.container_requests):
        if order is not None and (fast := order.answer(container)) is not None:
            response.container_responses.add(deviceIDs=fast)
            continue
        if isinstance(request, _PreferredAllocationWire):
            if strict is None:
                strict = _strict_preferred_request(request)
            container = strict.container_requests[number]
        available = dict.fromkeys(container.available_deviceIDs)  # a dict: each `in` below is one lookup
        chosen = list(dict.fromkeys(i for i in container.must_include_deviceIDs if i in available))
        response.container_responses.add(
            deviceIDs=_pick(resource, devices, available, chosen, container.allocation_size)
        )
    return response


# GetPreferredAllocation's request as the service reads it: the same messages, the same field
# numbers, but the IDs declared `bytes` instead of `string`, so that the same wire bytes parse into
# bytes objects. A `string` field costs twice for 50,000 IDs: protobuf checks the UTF-8 while
# parsing, then decodes each ID again into a str (about 1 ms of the 50,000-ID request, of the 4
# the Go test plugin needs for the whole call). Where _PreferredOrder answers, every offered ID is
# one the plugin lists, which is UTF-8 already; elsewhere the request is parsed again with the
# `string` type, so that an ID that is no UTF-8 is refused as before (_strict_preferred_request).
_PREFERRED_WIRE_MESSAGES = {
    "PreferredAllocationRequest": _MESSAGES["PreferredAllocationRequest"],
    "ContainerPreferredAllocationRequest": tuple(
        (name, number, type_.replace("string", "bytes"))
        for name, number, type_ in _MESSAGES["ContainerPreferredAllocationRequest"]
    ),
}
_PREFERRED_WIRE_POOL = descriptor_pool.DescriptorPool()  # its own: same package, same message names
_PREFERRED_WIRE_POOL.Add(
    _file_descriptor("gopherplug_preferred_wire.proto", messages=_PREFERRED_WIRE_MESSAGES, services={})
)
_PreferredAllocationWire = message_factory.GetMessageClass(
    _PREFERRED_WIRE_POOL.FindMessageTypeByName(f"{API_VERSION}.PreferredAllocationRequest")
)
_ContainerPreferredAllocationWire = message_factory.GetMessageClass(
    _PREFERRED_WIRE_POOL.FindMessageTypeByName(f"{API_VERSION}.ContainerPreferredAllocationRequest")
)
#: How device_plugin_service reads GetPreferredAllocation (METHODS keeps the v1beta1 type for callers).
_PREFERRED_WIRE_SIGNATURE = purerpc.RPCSignature(
    purerpc.Cardinality.UNARY_UNARY, _PreferredAllocationWire, v1beta1.PreferredAllocationResponse
)


def _strict_preferred_request(request: Any) -> Any:
    """The v1beta1 (``string``) form of a request read as _PreferredAllocationWire: an ID that is no
    UTF-8 is refused here as the server refuses any request it cannot parse."""
    try:
        return v1beta1.PreferredAllocationRequest.FromString(request.SerializeToString())
    except DecodeError as error:
        raise RPCError(StatusCode.INTERNAL, f"cannot parse the request: {error}") from None


class _PreferredOrder:
    """The order in which _pick takes a device set's IDs, worked out once for every request that
    cannot change it, and the answer to such a request taken from it.

    The kubelet sends GetPreferredAllocation every available ID of the resource (all the healthy
    ones not allocated yet: tens of thousands with replicas), and _pick sorts them each time:
    2.2 us an ID, 157 ms for 50,000, on the one event loop. But when no rank can differ between two
    candidates except by natural order, the rule's picks are the available IDs in natural order, and
    that is the natural order of *all* the IDs listed, with those not offered skipped: sorted once
    per device set, the answer is a walk of that list that stops after ``allocation_size`` offered
    IDs. That holds when:

    - the devices are on one NUMA node, or none has one: every candidate has node rank 0;
    - replicas is 1: uses count only devices already chosen, and those have no other ID; or
      replicas are packed, nothing must be included (every use is 0), and each device's IDs are
      together in natural order (device "g1" gives "g1::0".."g1::3", all before "g2::0"): packed
      takes devices whole in the order of their first candidate, which is then natural order too.

    Other requests (several NUMA nodes, spread replicas, an ID not listed now, an ID offered twice)
    return None from answer(), and _pick answers them.

    Costs, for 50,000 offered IDs: the offered IDs are struck off a copy of the listed ones (C loops
    over the request and the copy); what is left is the listed IDs *not* offered, usually few (the
    allocated ones), and the walk skips those. No set of the 50,000 offered IDs is built (that, and
    freeing it, was half of the call), and the IDs stay bytes as the request carries them
    (_PreferredAllocationWire): only the answer's are decoded. Building the order costs about what
    one _pick did, once per change of the device set."""

    def __init__(self, resource: ResourceConfig, devices: Mapping[str, DeviceEntry]) -> None:
        self.resource, self.devices = resource, devices  # what it was made for (the service compares)
        self.order: list[bytes] | None = None  # None: no request can be answered from an order
        self.listed: frozenset[bytes] = frozenset()  # the IDs, UTF-8 as on the wire
        if len({device.numa_node for device in devices.values()}) > 1:
            return  # the node to fill first depends on what is offered: _pick
        if resource.replicas == 1:
            ids = list(devices)
        elif resource.preferred == "packed":
            ids = [kubelet_id for device_id in devices for kubelet_id in resource.replica_ids(device_id)]
        else:
            return  # spread replicas: a device's j-th candidate depends on what is offered
        order = _natural_sorted(ids) if ids else []
        owners = resource.underlying_ids(order)
        if resource.replicas > 1 and sum(1 for _ in itertools.groupby(owners)) != len(devices):
            return  # a device's IDs apart ("a1::0" .. "a1::9", then "a1::10" after "a10::0"...): _pick
        try:
            self.order = [kubelet_id.encode() for kubelet_id in order]
        except UnicodeEncodeError:  # a name from sysfs with bytes that are no UTF-8: never on the wire
            self.order = None
            return
        self.listed = frozenset(self.order)

    def answer(self, container: Any) -> list[str] | None:
        """_pick's answer to one ContainerPreferredAllocationRequest, or None if this order cannot give it.

        ``container``: of _PreferredAllocationWire (as the service reads it) or of v1beta1."""
        if self.order is None:
            return None
        if not isinstance(container, _ContainerPreferredAllocationWire):  # a caller's v1beta1 message
            container = _ContainerPreferredAllocationWire.FromString(container.SerializeToString())
        offered = container.available_deviceIDs[:]  # one C call; iterating the field is twice as slow
        # The listed IDs not offered. The others, listed and offered, are as many as the offered IDs
        # only if each offered ID is listed and offered once: else _pick (an ID not listed ranks
        # among the others; one offered twice is one candidate).
        skipped = self.listed.difference(offered)
        if len(self.listed) - len(skipped) != len(offered):
            return None
        must_include = container.must_include_deviceIDs[:]
        try:
            for kubelet_id in must_include:  # few; the offered ones are listed, so UTF-8 already
                kubelet_id.decode()
        except UnicodeDecodeError:
            return None  # _pick's path parses the request again, and refuses it
        chosen = list(dict.fromkeys(i for i in must_include if i in self.listed and i not in skipped))
        need = container.allocation_size - len(chosen)
        if need > 0:
            if chosen and self.resource.replicas > 1:
                return None  # packed replicas of the chosen devices come first: _pick
            passed = skipped.union(chosen) if chosen else skipped  # (a frozenset: a copy, as rare as chosen)
            chosen += itertools.islice(itertools.filterfalse(passed.__contains__, self.order), need)
        return list(map(bytes.decode, chosen))


def _pick(
    resource: ResourceConfig, devices: Mapping[str, DeviceEntry], available: Iterable[str], chosen: list[str], size: int
) -> list[str]:
    """``chosen``, then the other available IDs in the order the rule picks them, up to ``size`` in all.

    The rule picks one ID at a time: the smallest by (node rank, sign * uses of its device, natural
    order), node rank 0 on a chosen NUMA node (or when none is chosen), else 1. Done literally, each
    pick looks at every candidate: 50,000 offered IDs took seconds (minutes for all 50,000) of the
    one event loop that also serves the kubelet's other calls. But the ranks change in only two ways, so that one sort
    puts the candidates in the order the rule picks them:

    - A device's uses change only when it is picked. Packed, that ranks it better still: once
      picked it is picked until its IDs run out, so devices are taken whole, in the order of (node
      rank, -uses, first ID). Spread, a device's j-th remaining ID ranks (node rank, uses + j) when
      its turn comes: a key fixed in advance, so the picks are the candidates sorted by it.
    - A node rank changes only when a pick adds a NUMA node, which happens only once no candidate
      on the chosen nodes is left: then every candidate on the new node ranks 0, in the order they
      already had (_pick_across_nodes)."""
    if len(chosen) >= size:
        return chosen
    taken = set(chosen)
    candidates = _natural_sorted([i for i in available if i not in taken])
    device_of = resource.underlying_ids(candidates)
    # The candidates' devices, in the order of their first candidate, with their NUMA nodes (None:
    # no topology, or no such device). getattr(None, ...) gives the default: no call per device.
    device_nodes = {d: getattr(devices.get(d or ""), "numa_node", None) for d in dict.fromkeys(device_of)}
    used = collections.Counter(resource.underlying_ids(chosen))
    # The NUMA node to fill first: the must-include devices' node, else the node offering the most.
    nodes = {getattr(devices.get(d or ""), "numa_node", None) for d in used} - {None}
    if not nodes:
        counts = collections.Counter(map(device_nodes.__getitem__, device_of))
        counts.pop(None, None)
        nodes = set(sorted(counts, key=lambda node: (-counts[node], node))[:1])
    # Node rank 1: off the chosen nodes. With no node chosen, no candidate has a node: all rank 0.
    near_nodes = nodes or {None}
    # Each candidate's key as one int, node rank * span + the rest, the rest < span: ints sort fast,
    # and sorted() is stable, so equal keys stay in natural order.
    most = max(used.values(), default=0)
    packed = resource.preferred == "packed"
    if packed:
        # The rest is the device's (-uses, place in device_nodes): (most - uses) * devices + place.
        span = (most + 1) * len(device_nodes)
        start = {
            d: (node not in near_nodes) * span + most * len(device_nodes) + place
            for place, (d, node) in enumerate(device_nodes.items())
        }
        per_use = -len(device_nodes)
    else:
        # The rest is uses + j: a device's IDs, in natural order, get uses + 0, uses + 1, ...
        span = most + len(candidates)
        start = {d: (node not in near_nodes) * span for d, node in device_nodes.items()}
        per_use = 1
    for d, uses in used.items():
        if d in start:
            start[d] += uses * per_use
    if packed:
        keys = list(map(start.__getitem__, device_of))
    else:
        keys = []
        for d in device_of:
            keys.append(key := start[d])
            start[d] = key + 1
    order = sorted(range(len(candidates)), key=keys.__getitem__)
    near = bisect.bisect_left(order, span, key=keys.__getitem__)  # node rank 0: they come first
    need = size - len(chosen)
    picked = list(map(candidates.__getitem__, order[:need]))
    if need > near:  # the chosen nodes run out: the rest, node by node
        rest = order[near:]
        picked[near:] = _pick_across_nodes(
            list(map(candidates.__getitem__, rest)),
            list(map(device_nodes.__getitem__, map(device_of.__getitem__, rest))),
            need - near,
        )
    return chosen + picked


def _pick_across_nodes(ranked: list[str], nodes: list[int | None], need: int) -> list[str]:
    """The first ``need`` of IDs off the chosen NUMA nodes, once the chosen nodes are used up:
    ``ranked`` in the order the rule picks them, each with its node (None: no topology).

    The first ID on a new node adds that node, so all that node's IDs rank first now: they come next,
    in their order. An ID without a node never adds one."""
    on_node: dict[int, list[str]] = {}
    for kubelet_id, node in zip(ranked, nodes, strict=True):
        if node is not None:
            on_node.setdefault(node, []).append(kubelet_id)
    picked: list[str] = []
    for kubelet_id, node in zip(ranked, nodes, strict=True):
        if len(picked) >= need:
            break
        if node is None:
            picked.append(kubelet_id)
        elif node in on_node:
            picked += on_node.pop(node)
    return picked[:need]


# Filesystems a container runtime makes for a container itself: its root (overlay) and its own /dev
# (a tmpfs). A host's /dev is devtmpfs, its root a disk's filesystem.
_CONTAINER_ROOT_FILESYSTEMS = {"overlay", "aufs", "fuse-overlayfs"}


def container_only_problem(directory: str, mountinfo: str) -> str | None:
    """Why ``directory`` looks like a path of the plugin's own container rather than the host's,
    given /proc/self/mountinfo's text; None when it is on a mount from the host (or no container).

    The container runtime opens a DeviceSpec's host_path on the host: a directory the plugin sees
    only inside its container offers devices whose paths lead nowhere, or elsewhere."""
    mounts = []
    for line in mountinfo.splitlines():
        mine, separator, theirs = line.partition(" - ")
        if separator and len(fields := mine.split()) > 4 and theirs.split():
            mount_point = fields[4].replace("\\040", " ")
            mounts.append((mount_point, theirs.split()[0]))
    under = [(point, fstype) for point, fstype in mounts if _is_under(directory, [point])]
    if not under:
        return None
    point, fstype = max(reversed(under), key=lambda mount: len(mount[0]))  # the last of the longest: on top
    if fstype in _CONTAINER_ROOT_FILESYSTEMS or (point == "/dev" and fstype == "tmpfs"):
        return (
            f"{directory} is on {point} ({fstype}), which looks like this container's own filesystem, not the "
            f"host's: the container runtime opens device paths on the host, so mount the host's directory at "
            f"the same path (a hostPath volume)"
        )
    return None


def deleted_directory_problem(directory: str, links: int | None, mountinfo: str) -> str | None:
    """Why ``directory`` is a deleted directory that this process still sees through a mount,
    given its link count (os.stat's st_nlink; None if it cannot be stat()ed) and
    /proc/self/mountinfo's text; None when it is live, or simply missing.

    A container's hostPath volume is a bind mount of the host's directory *as it was* when the
    container started. When the directory is removed on the host (the kubelet makes its
    device-plugin directory anew if it is missing), the mount keeps the deleted one: no link left,
    mountinfo's root field ends in "//deleted", nothing can be created in it, and nothing made in
    the new one ever shows. Only a new mount, that is a new container, sees the new directory."""
    deleted = links == 0
    for line in mountinfo.splitlines():
        fields = line.partition(" - ")[0].split()
        if len(fields) > 4 and fields[3].endswith("//deleted"):
            mount_point = fields[4].replace("\\040", " ")
            deleted = deleted or _is_under(directory, [mount_point])
    if not deleted:
        return None
    return (
        f"the device-plugin directory {directory} was removed on the host, and this container still sees the "
        "deleted one through its hostPath mount: exiting, so that the kubelet restarts it with a fresh mount"
    )


def cdi_spec(resource: ResourceConfig, devices: Iterable[DeviceEntry]) -> dict[str, Any] | None:
    """The CDI spec describing the resource's devices, or None when there is none to describe.

    One CDI device per device, named by its ID, with its device nodes and mounts, and
    <env>_<ID>=<id> in the container's env. Never <env> itself: that is the comma-joined list of
    every device a container was given, which Allocate sets in its env map and, under DRA, each
    request's own CDI device (claim_cdi_specs); a device's value would replace it, the runtime
    keeping the last value of a variable set twice (AddMultipleProcessEnv in
    cncf-tags/container-device-interface internal/ociedit). <env>_<ID> stays, for four reasons:
    CDI refuses a device with no edits (a device of plain files has neither node nor mount); these
    are the devices Allocate names for a CDI-aware runtime too, so a container sees the same env
    under either API; it is the device's own variable, so a container that gets a resource's
    devices from two requests or two claims, whose <env> is the last one's list, still sees each
    device; and consumers written for gopherplug's DRA before <env> was given there read it.

    A device node has its host node's mode and owner (fileMode, uid, gid), as a DeviceSpec gets
    them from the runtime: CDI fills in only a node's type and numbers from the host (newer CDI
    libraries the mode too, never the owner), and the runtime makes a node without them 0666
    root:root, writable by every user of the container."""
    assert resource.cdi is not None
    described = [{"name": device.id, "containerEdits": _cdi_edits(resource, device)} for device in devices]
    if not described:
        return None  # CDI refuses a spec without devices: the file is removed instead
    spec = {"cdiVersion": "", "kind": resource.cdi.kind, "devices": described}
    spec["cdiVersion"] = cdi_version(spec)
    return spec


def _cdi_edits(resource: ResourceConfig, device: DeviceEntry) -> dict[str, Any]:
    """One device's CDI containerEdits: <env>_<ID>=<id>, its device nodes and its mounts."""
    fields = {"id": device.id, "path": device.path}
    edits: dict[str, Any] = {"env": [f"{_device_env(resource, device.id)}={device.id}"]}
    nodes = [_cdi_node(spec, fields) for spec in device.device_specs]
    mounts = [
        {
            "hostPath": mount.host_path,
            "containerPath": mount.container_path.format(**fields),
            "options": ["bind", "ro" if mount.read_only else "rw"],
        }
        for mount in device.mounts
    ]
    if nodes:
        edits["deviceNodes"] = nodes
    if mounts:
        edits["mounts"] = mounts
    return edits


def _device_env(resource: ResourceConfig, device_id: str) -> str:
    """The variable a CDI device sets: <env>_<ID>, the ID upper-cased, other characters "_"."""
    return f"{resource.env}_{re.sub(r'[^A-Za-z0-9_]', '_', device_id).upper()}"


def dra_share_cdi_name(device_id: str, share_id: str) -> str:
    """The CDI device name of one share of a shared device: "<id>-<shareID>". The shareID is a
    lower-case UUID (validateUID in kubernetes/kubernetes pkg/apis/resource/validation), so the
    name keeps to CDI's rules (letters, digits, "_", "-", ".", ":"; a letter or digit at each end)
    wherever the ID does, and no two shares, of one claim or of two, have the same name."""
    return f"{device_id}-{share_id}"


def dra_claim_env_cdi_name(uid: str, request: str) -> str:
    """The CDI device name of a claim's env for one of its requests: "<claim UID>_<request>", the
    request as containers name it (dra_base_request). A UID and a request name (a DNS label) keep
    to CDI's rules for a name, and no device ID or share name of a real device is a UID, "_" and a
    request; the metadata's devices are named alike, in a kind of their own."""
    return f"{uid}_{request}"


#: A DRA driver's pools: pool name -> its resource and devices.
Pools = Mapping[str, tuple[ResourceConfig, Mapping[str, DeviceEntry]]]


def _claim_devices(
    claim: Mapping[str, Any], driver: str, pools: Pools
) -> Iterator[tuple[Any, ResourceConfig, DeviceEntry]]:
    """The results of a claim's allocation that are ``driver``'s, each with the resource and device
    it names in ``pools``; a result whose pool or device is not there is left out (prepared_devices
    refuses the claim)."""
    results = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []
    for result in results:
        pool = result.get("pool", "")
        if result.get("driver") == driver and pool in pools:
            resource, devices = pools[pool]
            device = next((d for d in devices.values() if dra_device_name(d.id) == result.get("device")), None)
            if device is not None:
                yield result, resource, device


def claim_env(claim: Mapping[str, Any], driver: str, pools: Pools) -> dict[tuple[CDIConfig, str], dict[str, str]]:
    """The env the device plugin's Allocate gives, per request of a claim: (CDI spec of the
    resource, request as containers name it) -> {<env>: "<id>,<id>"}, each value the IDs of the
    resource's devices allocated for that request, in the order of the claim's results, a device
    once (its shares are one device, as Allocate lists devices, not replicas). Requests in the
    order of their first result; a subrequest ("gpu/fast") counts as its request, whose devices
    it is. Two resources in one request (a DeviceClass that selects both) have each their own
    <env>; two of one CDI kind share the kind's CDI device (its name is per kind and request)."""
    kinds: dict[str, CDIConfig] = {}  # a kind's env device goes to the first spec of that kind
    ids: dict[tuple[CDIConfig, str], dict[str, list[str]]] = {}
    for result, resource, device in _claim_devices(claim, driver, pools):
        if resource.cdi is None:
            continue  # prepared_devices refuses the claim
        cdi = kinds.setdefault(resource.cdi.kind, resource.cdi)
        listed = ids.setdefault((cdi, dra_base_request(result.get("request", ""))), {}).setdefault(resource.env, [])
        if device.id not in listed:
            listed.append(device.id)
    return {key: {env: ",".join(listed) for env, listed in envs.items()} for key, envs in ids.items()}


def claim_cdi_specs(claim: Mapping[str, Any], driver: str, pools: Pools) -> list[tuple[ClaimCDISpec, dict[str, Any]]]:
    """The CDI specs of a claim of this driver's devices, one per CDI kind, as prepared_devices
    names their devices:

    - per request, the env the device plugin's Allocate would give its container (claim_env):
      <env>=<id>,<id>, in a CDI device of its own (dra_claim_env_cdi_name). The kubelet gives a
      container the CDI devices of the results of the request it names (cdiDevicesAsList in
      kubernetes/kubernetes pkg/kubelet/cm/dra/claiminfo.go), and no device's own CDI device sets
      <env> (cdi_spec): each request's containers see their list, whole;
    - each share of a device (a result with a shareID): its device's edits, plus
      <env>_<ID>_SHARE=<shareID>: the container can tell which share it holds (e.g. to pick its own
      part of a shared resource), and two containers of one device differ in their CDI devices."""
    uid = str((claim.get("metadata") or {}).get("uid", ""))
    specs: dict[CDIConfig, list[dict[str, Any]]] = {}
    for (cdi, request), envs in claim_env(claim, driver, pools).items():
        listed = {"env": [f"{env}={value}" for env, value in envs.items()]}
        specs.setdefault(cdi, []).append({"name": dra_claim_env_cdi_name(uid, request), "containerEdits": listed})
    for result, resource, device in _claim_devices(claim, driver, pools):
        if not (share := result.get("shareID")) or resource.cdi is None:
            continue  # not a share, or a claim prepared_devices refuses
        edits = _cdi_edits(resource, device)
        edits["env"] = [*edits["env"], f"{_device_env(resource, device.id)}_SHARE={share}"]
        specs.setdefault(resource.cdi, []).append(
            {"name": dra_share_cdi_name(device.id, share), "containerEdits": edits}
        )
    answer = []
    for cdi, described in specs.items():
        spec = {"cdiVersion": "", "kind": cdi.kind, "devices": described}
        spec["cdiVersion"] = cdi_version(spec)
        answer.append((ClaimCDISpec(cdi.kind, cdi.spec_dir, uid), spec))
    return answer


def _cdi_node(spec: DeviceSpecTemplate, fields: Mapping[str, str]) -> dict[str, Any]:
    """A DeviceSpec as a CDI deviceNode, with its host file's mode and owner when known. fileMode is
    the mode without its type bits (JSON has no octal: a number), as containerd takes it from a
    DeviceSpec's node and newer CDI libraries from the host: runc adds the node's type itself, and
    older runc versions do not strip type bits they are given."""
    node: dict[str, Any] = {
        "path": spec.container_path.format(**fields),
        "hostPath": spec.host_path,
        "permissions": spec.permissions,
    }
    if spec.host_mode is not None:
        node["fileMode"], node["uid"], node["gid"] = spec.host_mode
    return node


def cdi_version(spec: Mapping[str, Any]) -> str:
    """The lowest CDI version that has every feature ``spec`` uses, as CDI's own tooling declares it
    (MinimumRequiredVersion): a CDI library refuses a version it does not know, and runtimes vendor
    old ones (containerd 1.7 shipped CDI 0.5.4 and 0.6.2).

    The rules of container-device-interface specs-go/version.go, for what gopherplug writes:
    0.6.0 for a class with a "." in it; 0.5.0 for a device node's hostPath or a device name
    that does not begin with a letter; 0.3.0 otherwise. (0.4.0 is for a mount's type, 0.6.0
    also for annotations, 0.7.0 for intelRdt and additionalGIDs: gopherplug writes none. A
    device node's fileMode, uid and gid are in every version, 0.3.0 the earliest CDI accepts.)"""
    if "." in spec["kind"].partition("/")[2]:
        return "0.6.0"
    for device in spec["devices"]:
        nodes = device["containerEdits"].get("deviceNodes", ())
        if not device["name"][:1].isalpha() or any("hostPath" in node for node in nodes):
            return "0.5.0"
    return "0.3.0"


# 4d. DRA's pure part: the devices as ResourceSlices, claims answered from them ------------------------
#
# The scheduler, not the kubelet, picks devices under DRA. It reads ResourceSlices (resource.k8s.io/v1, 1.34+)
# from the API server: each names a driver, a node and a pool, and lists devices with attributes that
# DeviceClasses and claims select by CEL. gopherplug gives each DRA resource a pool of its own on each
# node ("<node>/<resource name>"), so that one resource's changes never touch another's slices.

#: Limits of resource.k8s.io/v1 (k8s.io/api/resource/v1 types.go): devices in one ResourceSlice
#: (ResourceSliceMaxDevices), characters of a string attribute (DeviceAttributeMaxValueLength).
DRA_MAX_DEVICES_PER_SLICE = 128
#: ... and in a slice where any device has a taint (ResourceSliceMaxDevicesWithTaintsOrConsumesCounters in
#: k8s.io/api/resource/v1 types.go; validateResourceSliceSpec applies it)
DRA_MAX_DEVICES_PER_SLICE_WITH_TAINTS = 64
#: The effects ``dra.unhealthy_taint`` may ask for: NoSchedule keeps new claims off an unhealthy
#: device, NoExecute also evicts the pods whose claims have it (KEP-5055, device taints)
DRA_TAINT_EFFECTS = ("NoSchedule", "NoExecute")
#: A taint's value when the reason is no label value (its full text is in the health stream)
DRA_UNHEALTHY_TAINT_VALUE = "unhealthy"
DRA_ATTRIBUTE_MAX_LENGTH = 64
_DNS_LABEL_LENGTH = 63


def _digest(text: str, length: int = 8) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def _dns_subdomain(text: str) -> str:
    """``text`` made a DNS subdomain: lower case, other characters "-", labels trimmed of "-"."""
    labels = re.sub(r"[^a-z0-9.-]", "-", text.lower()).split(".")
    return ".".join(label.strip("-") for label in labels if label.strip("-"))


def dra_pool_suffix(resource_name: str) -> str:
    """What a resource's pool names end with: its name as DNS subdomains ("example.com/my_dev" ->
    "example.com/my-dev"); pool names are DNS subdomains joined by "/" (validatePoolName in
    kubernetes/kubernetes pkg/apis/resource/validation/validation.go)."""
    return "/".join(_dns_subdomain(part) or _digest(part) for part in resource_name.split("/"))


#: The longest pool name the API server takes (PoolNameMaxLength, k8s.io/api/resource/v1 types.go);
#: and the longest object name (a DNS subdomain), a ResourceSlice's included.
DRA_POOL_NAME_MAX_LENGTH = 253
_DNS_SUBDOMAIN_LENGTH = 253


def dra_pool_name(node_name: str, resource_name: str) -> str:
    """The pool of one resource's devices on one node: "node-1/example.com/serial".

    A node name may have 253 characters itself, and the API server refuses a longer pool name, on
    every write, forever (validatePoolName). Such a name is cut and ends in a digest of the whole:
    still a DNS subdomain per "/" part, still one pool per node and resource."""
    name = f"{node_name}/{dra_pool_suffix(resource_name)}"
    if len(name) <= DRA_POOL_NAME_MAX_LENGTH:
        return name
    return f"{name[: DRA_POOL_NAME_MAX_LENGTH - 17].rstrip('/.-')}-{_digest(name, 16)}"


def dra_device_name(device_id: str) -> str:
    """A device's name in its ResourceSlice: a DNS label (validateDeviceName), so lower case letters,
    digits and "-". An ID that is one already is its own name; any other gets a digest of itself
    appended, so that "ttyUSB0" and "ttyusb0" stay two devices: "ttyusb0-" + 8 hex digits."""
    if re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", device_id) and len(device_id) <= _DNS_LABEL_LENGTH:
        return device_id
    readable = re.sub(r"[^a-z0-9]+", "-", device_id.lower()).strip("-")[: _DNS_LABEL_LENGTH - 9].strip("-")
    return f"{readable}-{_digest(device_id)}" if readable else _digest(device_id, 16)


#: The domain of the attributes Kubernetes defines for every driver (StandardDeviceAttributePrefix in
#: kubernetes/kubernetes staging/src/k8s.io/dynamic-resource-allocation/deviceattribute).
DRA_STANDARD_DOMAIN = "resource.kubernetes.io"
#: Its attributes' names (ibid.): declared in the driver's domain, one is warned about (_resource_warnings).
DRA_STANDARD_ATTRIBUTES = ("pcieRoot", "pciBusID", "numaNode", "localNUMANodes")


_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_LABEL_VALUE_LENGTH = 63


def dra_unhealthy_taint(driver: str, device: DeviceEntry, effect: str = "NoSchedule") -> dict[str, str]:
    """The taint of an unhealthy device in its ResourceSlice: key ``<driver>/unhealthy``, the
    configured effect, and the reason as its value when the reason is a label value (at most 63
    letters, digits, "-", "_" and "."; validateDeviceTaint), else DRA_UNHEALTHY_TAINT_VALUE. The
    full reason stays in the health stream and the log. No timeAdded: the API server adds it when
    the taint is first written, and the publisher keeps that one in every rewrite (_keep_taint_times)."""
    reason = device.problem
    value = reason if reason and len(reason) <= _LABEL_VALUE_LENGTH and _LABEL_VALUE.fullmatch(reason) else ""
    return {"key": f"{driver}/unhealthy", "value": value or DRA_UNHEALTHY_TAINT_VALUE, "effect": effect}


#: How long one read of a file the node owns may take (a value's file, the configuration): sysfs and
#: a ConfigMap's volume answer in microseconds. One past it (a hung device's sysfs file, a dead NFS or
#: FUSE mount, a FIFO) is given up, one line naming the file, its thread left to it: at most HUNG_READS
#: such threads at once, past which a read is given up at once.
FILE_READ_TIMEOUT, HUNG_READS = 5.0, 16
_READERS = threading.BoundedSemaphore(HUNG_READS)


def _file_text(path: str, limit: int = -1, errors: str = "surrogateescape") -> str:
    with open(path, encoding="utf-8", errors=errors) as file:
        return file.read(limit)


def _within(read: Callable[[], Any]) -> Any:
    """``read()`` in a worker thread, waited for FILE_READ_TIMEOUT at most: TimeoutError if it does not return."""
    if not _READERS.acquire(blocking=False):
        raise TimeoutError(errno.ETIMEDOUT, f"{HUNG_READS} earlier reads have not returned")
    answers: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def deliver(outcome: Any) -> None:
        _READERS.release()
        answers.put(outcome)

    trio.lowlevel.start_thread_soon(read, deliver)
    try:
        return answers.get(timeout=FILE_READ_TIMEOUT).unwrap()
    except queue.Empty:
        raise TimeoutError(errno.ETIMEDOUT, f"no answer within {FILE_READ_TIMEOUT:g} s") from None


@dataclass(frozen=True)
class ReadValues:
    """Attributes and capacity read for one device, from its ``attributes`` and ``capacity`` files
    or from ``describe``, not yet checked: attribute name -> (type, value), capacity name -> quantity."""

    attributes: Mapping[str, tuple[str, Any]] = dataclasses.field(default_factory=dict)
    capacity: Mapping[str, Any] = dataclasses.field(default_factory=dict)


#: The most of an attribute's or capacity's file that is read: a value is at most 64 bytes
_VALUE_FILE_BOUND = 4096


def read_declared_values(resource: ResourceConfig, device: DeviceEntry) -> tuple[ReadValues, list[tuple[str, str]]]:
    """Read the device's ``attributes`` and ``capacity`` files (DeclaredValue.file), their templates
    filled in for it: {id}, {path}, {name}, {target} (where a symlink leads) and {sysfs} (its
    directory in sysfs, DeviceEntry.sysfs). Returns what was read, typed, and a (key, why) for each
    file that could not be (a value not of its type is left for with_read_values to refuse)."""
    attributes: dict[str, tuple[str, Any]] = {}
    capacity: dict[str, Any] = {}
    problems: list[tuple[str, str]] = []
    fields: dict[str, str] | None = None
    for key, declared in [
        *((f"attributes.{d.name}", d) for d in resource.attributes if d.file),
        *((f"capacity.{d.name}", d) for d in resource.capacity if d.file),
    ]:
        if fields is None:
            fields = {"id": device.id, "path": device.path, "name": os.path.basename(device.path)}
            fields.update(target=os.path.realpath(device.path), sysfs=device.sysfs)
        if "{sysfs}" in declared.file and not (device.sysfs and os.path.isdir(device.sysfs)):
            problems.append((key, f"{declared.file}: no sysfs directory is known for this device"))
            continue
        path = declared.file.format(**fields)
        try:
            text = _within(functools.partial(_file_text, path, _VALUE_FILE_BOUND + 1, "replace"))
        except OSError as error:
            problems.append((key, f"cannot read {path}: {_describe(error)}"))
            continue
        if len(text) > _VALUE_FILE_BOUND:
            problems.append((key, f"{path} holds more than {_VALUE_FILE_BOUND} bytes, not one value"))
            continue
        text = text.strip()
        if declared.type == "quantity":
            capacity[declared.name] = text
        elif (value := _typed(declared.type, text)) is None:
            problems.append((key, f"{path} holds {text[:40]!r}, not a {declared.type}"))
        else:
            attributes[declared.name] = (declared.type, value)
    return ReadValues(attributes, capacity), problems


def _typed(kind: str, text: str) -> str | int | bool | None:
    """A file's text as a value of ``kind``: an int in decimal or with 0x/0o/0b (sysfs writes vendor
    IDs as 0x10de), a bool as 1/0, true/false, yes/no, y/n. None when it is not one."""
    if kind == "int":
        for base in (10, 0):
            try:
                return int(text, base)
            except ValueError:
                pass
        return None
    if kind == "bool":
        return {
            **dict.fromkeys(("1", "true", "yes", "y"), True),
            **dict.fromkeys(("0", "false", "no", "n"), False),
        }.get(text.lower())
    return text


_TOO_MANY_VALUES = f"left out: a device has at most {DRA_MAX_ATTRIBUTES_AND_CAPACITIES} attributes and capacities"


def _beyond_the_limit(resource: ResourceConfig, device: DeviceEntry) -> list[tuple[str, str]]:
    """What dra_device leaves out past the API server's 32 attributes and capacities a device (which
    refuses the slice, and the pool with it): the last capacities, then attributes, by name; (key, why).
    gopherplug's and sysfs's come first in both, at most 13 of them (with "shares"): never these."""
    keys = [f"attributes.{name}" for name in device_attributes(resource, device)]
    keys += [f"capacity.{name}" for name in device_capacity(resource, device)]
    return [(key, _TOO_MANY_VALUES) for key in keys[DRA_MAX_ATTRIBUTES_AND_CAPACITIES - (resource.replicas > 1) :]]


def with_read_values(
    resource: ResourceConfig, device: DeviceEntry, files: ReadValues, described: ReadValues | None = None
) -> tuple[DeviceEntry, list[tuple[str, str]]]:
    """The device carrying what was read for it (DeviceEntry.attributes and .capacity), checked as
    the API server checks a ResourceSlice's device, and why each value left out was: (key, why),
    e.g. ("attributes.model", "..."), for one line each.

    Its files first, then what ``describe`` said (a name in the driver's domain as one without). No
    value replaces another: gopherplug's own stay (describe may not call a device healthy), then
    sysfs's standard ones, a literal, a file's value before describe's; a different value is left
    out with a line saying which is used. Past the API server's 32 a device, the last are left out."""
    problems: list[tuple[str, str]] = []
    # What the device carries already (an embedding program's DeviceEntry may) is kept, as a literal
    # is, once it passes the same checks.
    if device.attributes or device.capacity:
        own_attributes, own_capacity = [], []
        for name, kind, value in device.attributes:
            if why := attribute_name_problem(name) or attribute_value_problem(kind, value):
                problems.append((f"attributes.{name}", f"the device's own: not valid for the API server: {why}"))
            else:
                own_attributes.append((name, kind, value))
        for name, written in device.capacity:
            quantity = canonical_quantity(written) if isinstance(written, str | int | float) else None
            if why := attribute_name_problem(name) or ("" if quantity else f"{written!r} is not a quantity"):
                problems.append((f"capacity.{name}", f"the device's own: not valid for the API server: {why}"))
            else:
                own_capacity.append((name, str(quantity)))
        if problems or any(a != b for a, b in zip(own_capacity, device.capacity, strict=True)):
            device = dataclasses.replace(device, attributes=tuple(own_attributes), capacity=tuple(own_capacity))
    if not (files.attributes or files.capacity or (described and (described.attributes or described.capacity))):
        return device, problems + _beyond_the_limit(resource, device)  # nothing read (literals only, or not yet)
    known = device_attributes(resource, device)  # gopherplug's own, sysfs's standard ones, the literals
    sysfs = {"numaNode": device.numa_node, "pciBusID": device.pci, "pcieRoot": device.pci}  # device_attributes'
    from_sysfs = {f"{DRA_STANDARD_DOMAIN}/{name}" for name, known in sysfs.items() if known is not None}
    known_capacity = {name: quantity["value"] for name, quantity in device_capacity(resource, device).items()}
    if resource.replicas > 1:
        known_capacity[DRA_SHARES_CAPACITY] = str(resource.replicas)
    room = DRA_MAX_ATTRIBUTES_AND_CAPACITIES - len(known) - len(known_capacity)
    attributes: dict[str, tuple[str, str | int | bool]] = {}
    capacity: dict[str, str] = {}

    def used(by: str, whose: str, said: Any, value: Any) -> str:
        return f"{whose} {said!r}, which is used, not {by}'s {value!r}"

    for values, by in ((files, "its file"), (described, "describe")):
        if values is None:
            continue
        for name, (kind, value) in values.attributes.items():
            name = name.removeprefix(f"{resource.driver}/") if resource.driver else name
            key = f"attributes.{name}"
            if "/" not in name and name in OWN_ATTRIBUTES:
                problems.append((key, f"is an attribute gopherplug gives every device itself: {by}'s is not used"))
            elif name in known:
                if known[name] != {kind: value}:
                    whose = "sysfs says" if name in from_sysfs else "the configuration says"
                    problems.append((key, used(by, whose, next(iter(known[name].values())), value)))
            elif name in attributes:
                if attributes[name] != (kind, value):
                    problems.append((key, used(by, "its file says", attributes[name][1], value)))
            elif why := attribute_name_problem(name) or attribute_value_problem(kind, value):
                problems.append((key, f"not valid for the API server: {why}"))
            elif room <= 0:
                problems.append((key, _TOO_MANY_VALUES))
            else:
                attributes[name] = (kind, value)
                room -= 1
        for name, written in values.capacity.items():
            name = name.removeprefix(f"{resource.driver}/") if resource.driver else name
            key = f"capacity.{name}"
            quantity = canonical_quantity(written) if isinstance(written, str | int | float) else None
            if name == DRA_SHARES_CAPACITY and resource.replicas > 1:
                problems.append((key, f"is the capacity gopherplug gives a shared device: {by}'s is not used"))
            elif name in known_capacity or name in capacity:
                said = known_capacity.get(name) or capacity[name]
                if said != quantity:
                    whose = "the configuration says" if name in known_capacity else "its file says"
                    problems.append((key, used(by, whose, said, written)))
            elif why := attribute_name_problem(name):
                problems.append((key, f"not valid for the API server: {why}"))
            elif quantity is None:
                problems.append((key, f"{written!r} is not a quantity (4, 80Gi, 1500m)"))
            elif room <= 0:
                problems.append((key, _TOO_MANY_VALUES))
            else:
                capacity[name] = quantity
                room -= 1
    attributes.update({name: (kind, value) for name, kind, value in device.attributes})
    capacity.update(device.capacity)
    entry = dataclasses.replace(
        device,
        attributes=tuple((name, *attributes[name]) for name in sorted(attributes)),
        capacity=tuple((name, capacity[name]) for name in sorted(capacity)),
    )
    return entry, problems + _beyond_the_limit(resource, entry)


def declared_attributes(resource: ResourceConfig, device: DeviceEntry) -> dict[str, dict[str, Any]]:
    """The attributes the user gave the device, as a ResourceSlice lists them: name (without a
    domain: the driver's) -> {type: value}, e.g. {"model": {"string": "H200"}}. The resource's
    literals, then what was read for this device (DeviceEntry.attributes), which cannot replace a
    literal. gopherplug's own are not here (device_attributes has them too)."""
    attributes = {value.name: {value.type: value.value} for value in resource.attributes if value.value is not None}
    for name, kind, value in device.attributes:
        attributes.setdefault(name, {kind: value})
    return attributes


def device_attributes(resource: ResourceConfig, device: DeviceEntry) -> dict[str, dict[str, Any]]:
    """Every attribute of the device in its ResourceSlice entry (dra_device): gopherplug's own, then
    declared_attributes. Of the standard ones (resource.kubernetes.io/numaNode, pciBusID, pcieRoot),
    what sysfs says wins over a declared or described value: it is the kernel's word for this very
    node; a declared one is used where sysfs knows none (an NVIDIA GPU's node has no sysfs link)."""
    attributes: dict[str, dict[str, Any]] = {
        "resource": {"string": resource.name},
        "id": {"string": device.id},
        "healthy": {"bool": device.health == HEALTHY},
    }
    if device.numa_node is not None:
        attributes["numaNode"] = {"int": device.numa_node}
        attributes[f"{DRA_STANDARD_DOMAIN}/numaNode"] = {"int": device.numa_node}
    if device.pci is not None:
        attributes[f"{DRA_STANDARD_DOMAIN}/pciBusID"] = {"string": device.pci.bus_id}
        attributes[f"{DRA_STANDARD_DOMAIN}/pcieRoot"] = {"string": device.pci.root}
    if (usb := device.usb) is not None:
        attributes["usbVendor"] = {"string": usb.vendor}
        attributes["usbProduct"] = {"string": usb.product}
        if usb.serial and usb.serial.isprintable() and len(usb.serial.encode()) <= DRA_ATTRIBUTE_MAX_LENGTH:
            attributes["usbSerial"] = {"string": usb.serial}
        bus = usb.port.removeprefix("usb").partition("-")[0]
        if bus.isascii() and bus.isdigit():
            attributes["usbBus"] = {"int": int(bus)}
        attributes["usbPort"] = {"string": usb.port}
    for name, value in declared_attributes(resource, device).items():
        attributes.setdefault(name, value)
    return attributes


def device_capacity(resource: ResourceConfig, device: DeviceEntry) -> dict[str, dict[str, str]]:
    """The capacity the user gave the device, as a ResourceSlice lists it: name -> {"value":
    quantity}, e.g. {"memory": {"value": "80Gi"}}: the resource's literals, then what was read for
    this device (DeviceEntry.capacity), a literal winning as in declared_attributes. A shared
    device's "shares" is dra_shares'."""
    capacity = {value.name: {"value": str(value.value)} for value in resource.capacity if value.value is not None}
    for name, quantity in device.capacity:
        capacity.setdefault(name, {"value": quantity})
    return capacity


def dra_device(
    resource: ResourceConfig, device: DeviceEntry, driver: str = "", unhealthy_taint: str = "NoSchedule"
) -> dict[str, Any]:
    """One device of a ResourceSlice. Its attributes, under the driver's domain (a name without
    one is in it), are what DeviceClasses and claims select by: ``resource`` (the resource's name),
    ``id`` (the device ID, as the env var and the CDI name spell it), ``healthy`` (as the
    device-plugin API's health), and ``numaNode`` when the device node has one.

    Beside them, the standard ones (DRA_STANDARD_DOMAIN) that selectors and constraints can use
    across drivers: ``numaNode``, and a PCI device's ``pciBusID`` and ``pcieRoot``, as
    k8s.io/dynamic-resource-allocation deviceattribute makes them; a USB device's ``usbVendor``,
    ``usbProduct``, ``usbSerial``, ``usbBus`` and ``usbPort`` in the driver's domain (docs/dra.md
    says what reads each). Past the API server's 32, the last declared are left out (_beyond_the_limit).

    With ``driver``, an unhealthy device carries dra_unhealthy_taint with the ``unhealthy_taint``
    effect: the scheduler allocates it only to a request that tolerates the taint (allTaintsTolerated
    in k8s.io/dynamic-resource-allocation structured), which is how an admin-access claim reaches it.

    The resource's ``attributes`` and ``capacity`` (device_attributes, device_capacity) are beside
    them, a capacity as {"value": quantity}. With ``replicas`` above 1, the device is shared (KEP-5075,
    consumable capacity): dra_shares; and each claim consumes of its declared capacity what it asks
    for (capacity.requests, nothing by default), within the value, where the cluster has consumable
    capacity (DRAConsumableCapacity, on from 1.36)."""
    attributes, capacity = device_attributes(resource, device), device_capacity(resource, device)
    for key, _ in _beyond_the_limit(resource, device):  # with_read_values says which, a line each
        kind, _, name = key.partition(".")
        del (attributes if kind == "attributes" else capacity)[name]
    listed: dict[str, Any] = {"name": dra_device_name(device.id), "attributes": attributes}
    if capacity:
        listed["capacity"] = capacity
    if resource.replicas > 1:
        # A shared device's declared capacity is consumed by the claims that ask for some of it
        # (capacity.requests), and only by them: without a requestPolicy, a claim that asks for
        # none would take the whole value (calculateConsumedCapacity in kubernetes/kubernetes
        # staging/src/k8s.io/dynamic-resource-allocation/structured/internal/incubating/
        # consumable_capacity.go), and the device would be one claim's after all.
        consumed = {"default": "0", "validRange": {"min": "0"}}
        shares = dra_shares(resource.replicas)
        listed["allowMultipleAllocations"] = shares["allowMultipleAllocations"]
        declared = {name: {**quantity, "requestPolicy": consumed} for name, quantity in capacity.items()}
        listed["capacity"] = {**declared, **shares["capacity"]}
    if driver and device.health != HEALTHY:
        listed["taints"] = [dra_unhealthy_taint(driver, device, unhealthy_taint)]
    return listed


#: The capacity a shared device offers, in shares; each claim's allocation consumes some of it.
DRA_SHARES_CAPACITY = "shares"


def dra_shares(replicas: int) -> dict[str, Any]:
    """What makes a device shared among ``replicas`` claims (KEP-5075, consumable capacity;
    Device.allowMultipleAllocations and Device.capacity in k8s.io/api resource/v1):

    - ``allowMultipleAllocations: true``: the scheduler may allocate the device to several claims
      at once, each allocation a share with its own shareID (a UUID) in the claim's result;
    - a capacity "shares" of value ``replicas``, which the allocations consume: the scheduler
      gives the device to another claim only while the shares consumed leave enough;
    - its requestPolicy: a claim that asks for no capacity (``capacity.requests``) consumes the
      default, 1, so ``replicas`` claims at most share the device; one may ask for more, whole
      shares from 1 to ``replicas`` (validRange, step 1).

    The API server takes a requestPolicy only on a device that allows multiple allocations, and
    checks it against the value (validateRequestPolicyRange in kubernetes/kubernetes
    pkg/apis/resource/validation/validation.go): min and max within the value, min plus one step
    too, default and max whole steps from min. Capacities count with the attributes towards the 32
    a device may have, not towards the devices of a slice (only taints and consumesCounters lower
    that to 64). With the DRAConsumableCapacity feature gate off (alpha in 1.34 and 1.35, beta and
    on from 1.36) the API server drops both fields and keeps the value: the device is then one
    claim's at a time, and SlicePublisher says so."""
    whole = str(replicas)
    policy = {"default": "1", "validRange": {"min": "1", "max": whole, "step": "1"}}
    return {
        "allowMultipleAllocations": True,
        "capacity": {DRA_SHARES_CAPACITY: {"value": whole, "requestPolicy": policy}},
    }


def dra_slice_name(node_name: str, driver: str, resource_name: str, index: int) -> str:
    """The name of a pool's index-th ResourceSlice: fixed, so that a restarted plugin finds and
    updates its slices instead of leaving old ones behind. A DNS subdomain of at most 253.

    Readable, then a digest of the exact node, driver and resource name: the readable part alone
    is not one name per pool ("example.com/foo-bar" and "example.com-foo/bar" both read
    "example.com-foo-bar"), and two pools sharing a slice name fight forever, as the API server
    refuses to move a slice to another pool (spec.pool.name is immutable)."""
    readable = _dns_subdomain(f"{node_name}-{driver}-{dra_pool_suffix(resource_name).replace('/', '-')}")
    digest = _digest(f"{node_name}\0{driver}\0{resource_name}", 10)
    room = _DNS_SUBDOMAIN_LENGTH - len(f"-{digest}-{index}")
    return f"{readable[:room].rstrip('.-')}-{digest}-{index}"


def node_owner(node_name: str, node_uid: str) -> dict[str, Any]:
    """The owner reference that makes a ResourceSlice its Node's: the garbage collector deletes the
    slices of a Node that is deleted (a node scaled away for good), which nobody else would. The Go
    helper's controller sets the same (resourceslice.Owner of kind Node, controller: true)."""
    return {"apiVersion": "v1", "kind": "Node", "name": node_name, "uid": node_uid, "controller": True}


def resource_slices(
    driver: str,
    node_name: str,
    resource: ResourceConfig,
    devices: Mapping[str, DeviceEntry],
    generation: int,
    node_uid: str = "",
    unhealthy_taint: str = "NoSchedule",
) -> list[dict[str, Any]]:
    """The ResourceSlices of one resource's pool on one node, as the API server takes them.

    At most DRA_MAX_DEVICES_PER_SLICE devices each; every slice of the pool carries the pool's
    generation and how many slices it has, so that the scheduler uses a pool only once it has seen
    all of one generation. A pool with no devices is one empty slice: the pool is there, and empty.
    The devices are in natural order of their IDs. With the Node's UID, each slice is owned by the
    Node (node_owner); without it, by nobody. An unhealthy device carries a taint with the
    ``unhealthy_taint`` effect (dra_device); while any device of the pool has one, its slices hold
    at most DRA_MAX_DEVICES_PER_SLICE_WITH_TAINTS devices, as the API server requires."""
    # In one order whatever order the devices were found in (natural: "g2" before "g10"): the
    # publisher compares slices as lists, and a restarted plugin that scanned the directory in
    # another order would otherwise rewrite unchanged pools under a new generation.
    listed = [dra_device(resource, devices[i], driver, unhealthy_taint) for i in _natural_sorted(list(devices))]
    size = DRA_MAX_DEVICES_PER_SLICE_WITH_TAINTS if any("taints" in d for d in listed) else DRA_MAX_DEVICES_PER_SLICE
    chunks = [listed[i : i + size] for i in range(0, len(listed), size)]
    chunks = chunks or [[]]
    pool = {
        "name": dra_pool_name(node_name, resource.name),
        "generation": generation,
        "resourceSliceCount": len(chunks),
    }
    owners = [node_owner(node_name, node_uid)] if node_uid else []
    return [
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {
                "name": dra_slice_name(node_name, driver, resource.name, index),
                **({"ownerReferences": [dict(owner) for owner in owners]} if owners else {}),
            },
            "spec": {"driver": driver, "nodeName": node_name, "pool": dict(pool), "devices": chunk},
        }
        for index, chunk in enumerate(chunks)
    ]


#: How long the kubelet may trust one health report (DeviceHealth.health_check_timeout_seconds; the
#: kubelet's own default, DefaultHealthTimeout in pkg/kubelet/cm/dra/healthinfo.go, is the same).
DRA_HEALTH_TIMEOUT = 30
#: The longest message the kubelet keeps; it cuts longer ones to 1021 characters and "...".
_DRA_HEALTH_MESSAGE_LENGTH = 1024


def dra_health_response(pools: Pools, now: float) -> Any:
    """Every device of ``pools`` (pool name -> its resource and devices) with its health, as
    NodeWatchResources streams it: named as in its ResourceSlice, unhealthy with the reason."""
    return drahealth.NodeWatchResourcesResponse(
        devices=[
            drahealth.DeviceHealth(
                device=drahealth.DeviceIdentifier(pool_name=pool, device_name=dra_device_name(device.id)),
                health=drahealth.HEALTHY if device.health == HEALTHY else drahealth.UNHEALTHY,
                last_updated_time=int(now),
                health_check_timeout_seconds=DRA_HEALTH_TIMEOUT,
                message=device.problem[:_DRA_HEALTH_MESSAGE_LENGTH],
            )
            for pool, (_, devices) in sorted(pools.items())
            for device in devices.values()
        ]
    )


#: The most bytes of one device's status data the API server takes (AllocatedDeviceStatusDataMaxLength
#: in k8s.io/api/resource/v1 types.go).
DRA_STATUS_DATA_MAX_LENGTH = 10 * 1024


def claim_device_status(claim: Mapping[str, Any], driver: str, pools: Pools) -> list[dict[str, Any]]:
    """The claim's status.devices entries for ``driver``'s results (KEP-4817, AllocatedDeviceStatus
    in k8s.io/api/resource/v1): one per device of this driver's pools, named by driver, pool and
    device as its result is (the API server refuses an entry that matches no result), with
    ``data`` a JSON object: the device's ID and its paths on the node (each member's, for a device
    of several entries). Paths are left out if they would make data longer than the API takes."""
    # A share's entry names its shareID too: the API server matches an entry to a result by
    # driver, pool, device and shareID (validateDeviceStatus), so each share of a device has one.
    entries: dict[tuple[str, str, str], dict[str, Any]] = {}
    for result, _, device in _claim_devices(claim, driver, pools):
        pool, name, share = result.get("pool", ""), result.get("device", ""), result.get("shareID") or ""
        if (pool, name, share) in entries:
            continue
        shared = {"shareID": share} if share else {}
        data: dict[str, Any] = {"id": device.id, "paths": [m.path for m in device.members] or [device.path]}
        if len(json.dumps(data)) > DRA_STATUS_DATA_MAX_LENGTH:
            data = {"id": device.id}
        entries[pool, name, share] = {"driver": driver, "pool": pool, "device": name, **shared, "data": data}
    return list(entries.values())


def dra_base_request(request: str) -> str:
    """The request a container names for an allocation result's ``request``: "gpu" for "gpu" and
    for "gpu/fast". With a prioritized list (firstAvailable) the scheduler writes the subrequest it
    chose as "<request>/<subrequest>", but a container's resources.claims[].request names only the
    main request, and the kubelet gives it the CDI devices whose request_names contain exactly that
    (cdiDevicesAsList in pkg/kubelet/cm/dra/claiminfo.go): answered unstripped, the device reaches no
    container and nothing reports an error. The Go helper strips them too (stripSubrequestNames)."""
    return request.split("/", 1)[0]


def prepared_devices(claim: Mapping[str, Any], uid: str, driver: str, pools: Pools) -> list[Any]:
    """The devices a ResourceClaim (as the API server returns it) was allocated from this driver's
    ``pools`` (pool name -> its resource and devices), as NodePrepareResources answers them.

    The allocation is in status.allocation.devices.results: one result per device, naming its
    request, driver, pool and device. Results of other drivers are theirs to prepare. Each device
    names its CDI device (its share's, for a shared one), and the first of each request (per CDI
    kind) the request's env too, <env>=<id>,<id>: claim_cdi_specs has the claim's own devices. Raises
    ClaimError when the claim is another than the kubelet meant (its UID differs: deleted and made
    again under the same name), is not allocated, was allocated on another node, or a device is
    gone or unhealthy now.

    A result with ``adminAccess: true`` (KEP-5018, GA in 1.36: the scheduler gave the device to a
    claim in a namespace labelled resource.kubernetes.io/admin-access, for monitoring or
    maintenance, although other claims may have it) is prepared also when the device is unhealthy,
    which is when an administrator most needs to look at it. Nothing here keeps one device to one
    claim: the scheduler does, and it is the scheduler that lets an admin-access result share a
    device that other claims hold, so such a claim is prepared beside theirs. The kubelet does
    nothing of its own for admin access: NodePrepareResources names the claim only
    (pkg/kubelet/cm/dra), and the driver reads the result."""
    metadata = claim.get("metadata") or {}
    name = f"{metadata.get('namespace')}/{metadata.get('name')}"
    if metadata.get("uid") != uid:
        raise ClaimError(f"ResourceClaim {name} has UID {metadata.get('uid')}, not {uid}: it was replaced")
    allocation = (claim.get("status") or {}).get("allocation")
    if not allocation:
        raise ClaimError(f"ResourceClaim {name} is not allocated")
    results = [r for r in (allocation.get("devices") or {}).get("results") or [] if r.get("driver") == driver]
    if not results:
        raise ClaimError(f"ResourceClaim {name} has no device of driver {driver}")
    answer = []
    env_named: set[tuple[str, str]] = set()  # (CDI kind, request) whose env CDI device is named
    for result in results:
        pool, device_name = result.get("pool", ""), result.get("device", "")
        if pool not in pools:
            raise ClaimError(f"ResourceClaim {name}: device {device_name} is from pool {pool}, not one of this node's")
        resource, devices = pools[pool]
        device = next((d for d in devices.values() if dra_device_name(d.id) == device_name), None)
        if device is None:
            raise ClaimError(f"ResourceClaim {name}: device {device_name} of pool {pool} is not there any more")
        if device.health != HEALTHY and result.get("adminAccess") is not True:
            raise ClaimError(
                f"ResourceClaim {name}: device {device.id} of {resource.name} is unhealthy: {device.problem}"
            )
        # Admin access reaches an unhealthy device, but only one that is there to give. A node or
        # file whose host path is gone (a dangling symlink, a device unplugged) would not stop the
        # container: the runtime starts it without the node, the env still naming the device, and
        # nothing reports it. Refused, the kubelet fails the pod's start with this line instead.
        gone = (
            [e.path for e in device.members or (device,) if not os.path.exists(e.path)]
            if device.health != HEALTHY
            else []
        )
        if gone:
            raise ClaimError(
                f"ResourceClaim {name}: device {device.id} of {resource.name} is unhealthy ({device.problem}) and "
                f"{gone[0]} is not there: nothing to give a container, even with admin access"
            )
        assert resource.cdi is not None  # parse_config gives every DRA resource one
        # A share of a shared device (dra_shares): the scheduler gave this claim one allocation of
        # it, named by shareID, and the answer carries it (the kubelet keeps it with the device).
        # Its own CDI device (claim_cdi_specs) is the device's plus the share's ID.
        share = result.get("shareID")
        if share is not None and not _UUID.fullmatch(str(share)):
            raise ClaimError(f"ResourceClaim {name}: device {device_name} has shareID {share!r}, not a lower-case UUID")
        cdi_name = dra_share_cdi_name(device.id, share) if share else device.id
        request = dra_base_request(result.get("request", ""))
        cdi_ids = [f"{resource.cdi.kind}={cdi_name}"]
        # The request's env, <env>=<id>,<id> as Allocate gives it (claim_cdi_specs writes it), named
        # on the request's first device of the kind only: the kubelet gives a container the CDI
        # devices of every device of the request it names, and one is enough.
        if (resource.cdi.kind, request) not in env_named:
            env_named.add((resource.cdi.kind, request))
            cdi_ids.append(f"{resource.cdi.kind}={dra_claim_env_cdi_name(uid, request)}")
        shared = {"share_id": share} if share else {}
        prepared = drapb.Device(
            request_names=[request], pool_name=pool, device_name=device_name, cdi_device_ids=cdi_ids, **shared
        )
        answer.append(prepared)
    return answer


#: A UID as the API server takes one (validateUID): RFC 4122 form, lower-case hexadecimal digits
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


# Device metadata (KEP-5304): what a container was given, in a file it reads.

#: Where a container finds the metadata files of the devices it holds: ContainerDir in
#: kubernetes/dynamic-resource-allocation api/metadata/types.go, a path consumers build themselves.
DRA_METADATA_CONTAINER_DIR = "/var/run/kubernetes.io/dra-device-attributes"
#: The API versions each file holds, one object per version, newest first: a reader takes the first
#: it can decode. v1beta1 is the one Kubernetes 1.37's helper must write; v1alpha1 is 1.36's, kept
#: for readers built against it (the fields are the same).
DRA_METADATA_VERSIONS = ("metadata.resource.k8s.io/v1beta1", "metadata.resource.k8s.io/v1alpha1")
#: The annotation of a claim made from a ResourceClaimTemplate that names it as the pod does
#: (pod.spec.resourceClaims[].name; PodResourceClaimAnnotation in k8s.io/api resource/v1).
DRA_POD_CLAIM_ANNOTATION = "resource.kubernetes.io/pod-claim-name"


def dra_metadata_cdi_kind(driver: str) -> str:
    """The CDI kind of the metadata mounts: "<driver>/metadata", the Go helper's."""
    return f"{driver}/metadata"


@dataclass(frozen=True)
class DeviceMetadataFile:
    """One request's device metadata file: where it is on the host and in the container, and its text."""

    request: str  #: the request as containers name it (dra_base_request)
    host_path: str
    container_path: str
    text: str


def dra_claim_metadata_dir(metadata_dir: str, namespace: str, name: str, uid: str) -> str:
    """A claim's directory of metadata files on the host: "<namespace>_<name>_<uid>" (neither a
    namespace nor a name has a "_"). The Go helper's is "<namespace>_<name>"; the UID is added here
    because a claim deleted and made again under its name may be prepared before the kubelet
    unprepares the old one, and the old one's unprepare must not remove the new one's files."""
    return os.path.join(metadata_dir, f"{namespace}_{name}_{uid}")


def device_metadata_files(
    claim: Mapping[str, Any], driver: str, pools: Pools, metadata_dir: str
) -> list[DeviceMetadataFile]:
    """The device metadata files of a claim that prepared_devices accepted (KEP-5304, the protocol
    of kubernetes/dynamic-resource-allocation api/metadata, as its kubeletplugin writes it):

    - one file per request, with this driver's devices of it: ``driver``, ``pool``, ``name`` and
      ``attributes``, the attributes the device has in its ResourceSlice (dra_device's, the same
      function: a container sees what the scheduler selected by), keys in order as Go writes a map;
    - on the host "<metadata_dir>/<namespace>_<name>_<uid>/<request>/metadata.json"; in the
      container ".../resourceclaims/<claim>/<request>/<driver>-metadata.json", or for a claim made
      from a template ".../resourceclaimtemplates/<pod's name for it>/<request>/..." (its generated
      name is nothing the pod's author knows). A subrequest of a prioritized list
      ("gpu/fast") is in the file's ``requests[].name``, its main request in the path;
    - the text a stream of one DeviceMetadata per DRA_METADATA_VERSIONS, each indented by two
      spaces as the helper's pretty JSON serializer writes it, each ended by a newline;
      ``metadata`` the claim's name, namespace and UID, and ``generation`` 1 (gopherplug writes a
      file once: a later change would be generation 2, which consumers watch for)."""
    metadata = claim.get("metadata") or {}
    namespace, name, uid = str(metadata.get("namespace", "")), str(metadata.get("name", "")), str(metadata.get("uid"))
    pod_claim_name = (metadata.get("annotations") or {}).get(DRA_POD_CLAIM_ANNOTATION) or None
    by_request: dict[str, list[dict[str, Any]]] = {}  # full request reference -> its devices
    for result, resource, device in _claim_devices(claim, driver, pools):
        pool, device_name = result.get("pool", ""), result.get("device", "")
        attributes = dra_device(resource, device)["attributes"]
        ordered = {key: attributes[key] for key in sorted(attributes)}
        entry = {"driver": driver, "pool": pool, "name": device_name, "attributes": ordered}
        by_request.setdefault(str(result.get("request", "")), []).append(entry)
    files = []
    for request, listed in by_request.items():
        base = dra_base_request(request)
        if pod_claim_name:
            inside = os.path.join(DRA_METADATA_CONTAINER_DIR, "resourceclaimtemplates", pod_claim_name)
        else:
            inside = os.path.join(DRA_METADATA_CONTAINER_DIR, "resourceclaims", name)
        objects = []
        for version in DRA_METADATA_VERSIONS:
            document: dict[str, Any] = {
                "kind": "DeviceMetadata",
                "apiVersion": version,
                "metadata": {"name": name, "namespace": namespace, "uid": uid, "generation": 1},
            }
            if pod_claim_name:
                document["podClaimName"] = pod_claim_name
            document["requests"] = [{"name": request, "devices": listed}]
            objects.append(json.dumps(document, indent=2, ensure_ascii=False) + "\n")
        host = os.path.join(dra_claim_metadata_dir(metadata_dir, namespace, name, uid), base, "metadata.json")
        files.append(
            DeviceMetadataFile(base, host, os.path.join(inside, base, f"{driver}-metadata.json"), "".join(objects))
        )
    return files


def device_metadata_cdi_spec(
    uid: str, driver: str, files: Iterable[DeviceMetadataFile], spec_dir: str
) -> tuple[ClaimCDISpec, dict[str, Any]] | None:
    """The claim's CDI spec that mounts its metadata files: kind dra_metadata_cdi_kind, a device
    "<claim UID>_<request>" per file whose only edit is the file bind-mounted read-only at its
    container path (options "ro", "bind", as the Go helper's). A file of the claim's own beside
    its shares' (ClaimCDISpec), kept in the checkpoint with them; None without files."""
    described = [
        {
            "name": f"{uid}_{each.request}",
            "containerEdits": {
                "mounts": [
                    {"hostPath": each.host_path, "containerPath": each.container_path, "options": ["ro", "bind"]}
                ]
            },
        }
        for each in files
    ]
    if not described:
        return None
    kind = dra_metadata_cdi_kind(driver)
    spec = {"cdiVersion": "", "kind": kind, "devices": described}
    spec["cdiVersion"] = cdi_version(spec)
    return ClaimCDISpec(kind, spec_dir, uid), spec


def add_metadata_cdi_devices(devices: list[Any], driver: str, uid: str, files: Iterable[DeviceMetadataFile]) -> None:
    """Name each request's metadata CDI device in the answer, on the first device of the request
    only, as the Go helper does: the kubelet gives a container the CDI devices of every device of
    the request it names, and one mount is enough."""
    pending = {each.request for each in files}
    for device in devices:
        for request in device.request_names:
            if request in pending:
                device.cdi_device_ids.append(f"{dra_metadata_cdi_kind(driver)}={uid}_{request}")
                pending.discard(request)


# 4e. What the node reports: NFD labels, who holds a device --------------------------------------------
# Node Feature Discovery: what the device plugin can say about its devices besides their number.
# The kubelet's device manager knows only counts: a pod cannot ask for "a GPU of that model" through
# resources.limits. NFD turns lines of a file in its features.d directory into node labels, and a
# pod's nodeSelector (or node affinity) picks nodes by them: nfd_features writes those lines.

#: The label namespace NFD gives a feature file's names (FeatureLabelNs in kubernetes-sigs/
#: node-feature-discovery api/nfd/v1alpha1/annotations_labels.go), written out: the same label
#: whether nfd-master adds it or refuses a name without it (its DisableAutoPrefix gate).
NFD_LABEL_NAMESPACE = "feature.node.kubernetes.io"
#: The largest feature file NFD reads (MaxFeatureFileSize in source/local/local.go): it skips a
#: larger one whole, every label of it.
NFD_MAX_FEATURE_FILE_SIZE = 65536
#: gopherplug's own attributes that are no property of the devices, so no label: ``resource`` is
#: in every label's name, ``id`` tells devices apart, ``healthy`` is in the count.
_NFD_OWN_ATTRIBUTES = {"resource", "id", "healthy"}


def nfd_label_name(resource_name: str, key: str) -> str:
    """The label of a resource's feature ``key``: "feature.node.kubernetes.io/<domain>-<name>.<key>",
    "/" made "-" (a label's name, after its namespace, is at most 63 letters, digits, "-", "_" and
    "." beginning and ending with a letter or digit; a resource's name and an attribute's are of
    those). A longer one keeps its first 54 characters and ends in 8 hex digits of its SHA-256: the
    same resource and key, the same label, on every node."""
    part = f"{resource_name.replace('/', '-')}.{key.replace('/', '-')}"
    if len(part) > _LABEL_VALUE_LENGTH or not _LABEL_VALUE.fullmatch(part):  # "model_": NFD drops it
        digest = hashlib.sha256(part.encode()).hexdigest()[:8]
        part = f"{part[: _LABEL_VALUE_LENGTH - 9].rstrip('-_.')}-{digest}"
    return f"{NFD_LABEL_NAMESPACE}/{part}"


def nfd_label_value(typed: Mapping[str, Any]) -> str | None:
    """An attribute's value ({"string": "NVIDIA H200"}) as a label's value (IsValidLabelValue, which
    NFD's validate.Label applies), or None when none can stand for it: a boolean "true" or "false",
    an integer its digits (a negative one none: "1" would lie); a string or a version made one as
    NVIDIA's gpu-feature-discovery makes its product names: each run of other characters a "-",
    cut to 63, its ends trimmed ("NVIDIA H200" is "NVIDIA-H200"; "1.2.3+build.7" "1.2.3-build.7")."""
    [(kind, value)] = typed.items()
    if kind == "bool":
        return "true" if value else "false"
    if kind == "int":
        return str(value) if value >= 0 else None
    text = str(value)
    if len(text) <= _LABEL_VALUE_LENGTH and _LABEL_VALUE.fullmatch(text):
        return text
    made = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-_.")[:_LABEL_VALUE_LENGTH].rstrip("-_.")
    return made or None


def nfd_labels(resource: ResourceConfig, devices: Mapping[str, DeviceEntry]) -> dict[str, str]:
    """A resource's node labels (nfd_label_name -> value): ``count``, its healthy devices (an
    integer, which node affinity's Gt and Lt compare), then each attribute all its devices share
    (device_attributes), by name (the standard domain's without it). An attribute with no label
    value (nfd_label_value), or whose label another has already, has none."""
    labels = {nfd_label_name(resource.name, "count"): str(sum(d.health == HEALTHY for d in devices.values()))}
    # What device_attributes reads of a device beside its ID and health: devices alike in these have
    # the same attributes here, and one of them stands for all (10,000 files: one, not 10,000 dicts).
    alike = {(d.numa_node, d.pci, d.usb, d.attributes): d for d in devices.values()}
    shared: dict[str, dict[str, Any]] | None = None
    for device in alike.values():
        found: dict[str, dict[str, Any]] = {}
        for name, typed in device_attributes(resource, device).items():
            if name not in _NFD_OWN_ATTRIBUTES:
                domain, _, base = name.rpartition("/")
                found.setdefault(base if domain == DRA_STANDARD_DOMAIN else name, typed)
        shared = found if shared is None else {key: typed for key, typed in shared.items() if found.get(key) == typed}
        if not shared:
            break
    for key, typed in sorted((shared or {}).items()):
        if (value := nfd_label_value(typed)) is not None:
            labels.setdefault(nfd_label_name(resource.name, key), value)
    return labels


def nfd_features(resources: Iterable[tuple[ResourceConfig, Mapping[str, DeviceEntry]]]) -> str:
    """The text of the NFD feature file (nfd_features_file): each resource's labels (nfd_labels),
    one "<name>=<value>" line each, resources in the order given, after a comment saying whose the
    file is (NFD's local source skips lines that begin with "#"; "# +" would be a directive)."""
    lines = [
        "# Written by gopherplug (nfd_features_file) whenever the devices change, and removed when it stops:",
        "# per resource the count of healthy devices and each attribute all of its devices share.",
    ]
    for resource, devices in resources:
        lines += [f"{name}={value}" for name, value in nfd_labels(resource, devices).items()]
    return "\n".join(lines) + "\n"


# Who holds which device: the kubelet's PodResources answer, read against the configuration.


@dataclass(frozen=True)
class Holder:
    """A container that holds a device, as the kubelet's PodResources List tells it."""

    namespace: str
    pod: str
    container: str
    via: str  #: "device plugin", or "claim <namespace>/<name>" (DRA)
    share: str = ""  #: the replica (device plugin) or shareID (DRA) when the device is shared


@dataclass(frozen=True)
class HeldDevice:
    """One device of a configured resource, and every container holding it (none: free)."""

    resource: str
    device_id: str
    path: str
    health: str
    problem: str
    holders: tuple[Holder, ...]


def device_holders(
    resources: Iterable[tuple[ResourceConfig, Iterable[DeviceEntry]]],
    pods: Iterable[Any],
    driver: str = "",
    node_name: str = "",
) -> list[HeldDevice]:
    """Each device of each resource with the containers that hold it, from PodResources' pods.

    The kubelet knows a device-plugin device by the ID it was offered under (a replica's
    "<id>::<n>"), per container that Allocate was called for; a DRA device by driver, pool and
    device name, per claim and container that names the claim. Not by CDI device: the kubelet fills
    a claim's ClaimResource.cdi_devices from a list it does not reset between one driver's devices
    (GetDynamicResources in kubernetes/kubernetes pkg/kubelet/cm/container_manager_linux.go), so the
    second device of a claim also carries the first one's. A device a pod holds that the
    configuration no longer has (removed, or gone from its directory) is not listed: who holds it
    is the kubelet's to say (``gopherplug who`` shows only this configuration's devices)."""
    found: dict[tuple[str, str], list[Holder]] = collections.defaultdict(list)
    by_name = {}  # for DRA: (pool, device name) -> (resource, device ID)
    resources = [(resource, list(devices)) for resource, devices in resources]
    for resource, devices in resources:
        if resource.dra:
            pool = dra_pool_name(node_name, resource.name)
            by_name.update({(pool, dra_device_name(d.id)): (resource.name, d.id) for d in devices})
    configured = {resource.name: resource for resource, _ in resources}
    listed = {resource.name: devices for resource, devices in resources}
    offered = {resource.name: {d.id for d in devices} for resource, devices in resources}
    others: dict[str, dict[str, str]] = {}  # per resource, generic-device-plugin's ID -> our device's, when needed
    for pod in pods:
        for container in pod.containers:
            where = (pod.namespace, pod.name, container.name)
            for held in container.devices:
                plugin = configured.get(held.resource_name)
                if plugin is None or not plugin.device_plugin:
                    continue
                for kubelet_id in held.device_ids:
                    device_id = plugin.underlying_id(kubelet_id) or kubelet_id
                    share = kubelet_id.rpartition(REPLICA_SEPARATOR)[2] if plugin.replicas > 1 else ""
                    via = "device plugin"
                    if device_id not in offered[plugin.name]:
                        # Held since before a switch from generic-device-plugin, under its ID
                        # (hold_back_foreign_holds): our device it is, where that can be told.
                        if plugin.name not in others:
                            others[plugin.name] = {
                                gdp_id: d.id for d in listed[plugin.name] for gdp_id in generic_device_plugin_ids(d)
                            }
                        if (ours := others[plugin.name].get(kubelet_id)) is not None:
                            device_id, via = ours, f"device plugin, under another plugin's ID {kubelet_id[:12]}…"
                            share = ""
                    found[plugin.name, device_id].append(Holder(*where, via, share))
            for claim in container.dynamic_resources:
                via = f"claim {claim.claim_namespace}/{claim.claim_name}"
                for result in claim.claim_resources:
                    if result.driver_name != driver:
                        continue
                    if (known := by_name.get((result.pool_name, result.device_name))) is not None:
                        share = result.share_id if result.HasField("share_id") else ""
                        # The kubelet may list a claim's device more than once: it appends a claim's
                        # devices at every try of a batch that failed (ClaimInfo.addDevice in
                        # pkg/kubelet/cm/dra/claiminfo.go). One container holds it once.
                        if (holder := Holder(*where, via, share)) not in found[known]:
                            found[known].append(holder)
    return [
        HeldDevice(resource.name, d.id, d.path, d.health, d.problem, tuple(found.get((resource.name, d.id), ())))
        for resource, devices in resources
        for d in devices
    ]


def who_report(held: Iterable[HeldDevice]) -> str:
    """`gopherplug who`: a line per device, its health, its path and who holds it (or free)."""
    lines = []
    for device in held:
        health = device.health if not device.problem else f"{device.health} ({device.problem})"
        holders = [
            f"{h.namespace}/{h.pod}/{h.container} ({h.via}{f', share {h.share}' if h.share else ''})"
            for h in device.holders
        ]
        lines.append(f"{device.resource} {device.device_id} {device.path}: {health}: {', '.join(holders) or 'free'}")
    return "\n".join(lines)


# Devices held under another plugin's IDs: a node switched from generic-device-plugin.
#
# The kubelet's device manager keeps one plugin per resource name (ManagerImpl.PluginConnected in
# kubernetes/kubernetes pkg/kubelet/cm/devicemanager/manager.go sets endpoints[resourceName]: a
# later registration replaces the earlier), and it knows devices by ID alone. The pods a previous
# plugin served keep their allocation (podDevices, saved in kubelet_internal_checkpoint): their
# containers run on, and the IDs stay "in use" until the pod ends. But a new plugin's list
# replaces the old one's (genericDeviceUpdateCallback), and devicesToAllocate picks from the
# healthy IDs minus the IDs in use: a port generic-device-plugin gave a running pod as
# sha1("0/dev/ttyUSB0") is, to the kubelet, not the `ttyUSB0` gopherplug offers, which it may hand
# to the next pod. Nothing in the API lets a plugin say "in use": it can report the device
# Unhealthy, which the kubelet does not choose, until the pod ends (hold_back_foreign_holds).

#: generic-device-plugin's `count` values tried when recognising its IDs (its default is 1; a
#: shared device such as /dev/fuse is given a count of 10 or so)
GENERIC_DEVICE_PLUGIN_COUNTS = 128


def generic_device_plugin_ids(device: DeviceEntry, counts: int = GENERIC_DEVICE_PLUGIN_COUNTS) -> set[str]:
    """The IDs generic-device-plugin gives the same device node(s): for a `paths` group, the
    hexadecimal SHA-1 of the copy's number (0 up to the group's count) followed by each path the
    group matched, in the group's order (discoverPath in squat/generic-device-plugin
    deviceplugin/path.go). A device of several entries is tried with its members in gopherplug's
    order, which is the group's when its paths are listed in that order. A `usb` group's IDs are
    made otherwise and are not recognised."""
    paths = "".join(member.path for member in device.members or (device,)).encode()
    return {hashlib.sha1(str(copy).encode() + paths, usedforsecurity=False).hexdigest() for copy in range(counts)}


@dataclass(frozen=True)
class ForeignHold:
    """A device of a resource a running container holds under an ID this plugin does not offer."""

    holder: Holder
    kubelet_id: str  #: the ID the kubelet booked it under
    device_id: str  #: this plugin's device it is (recognised as generic-device-plugin's ID); "" unknown


def foreign_holds(resource: ResourceConfig, devices: Iterable[DeviceEntry], pods: Iterable[Any]) -> list[ForeignHold]:
    """The containers of PodResources' ``pods`` holding a device of ``resource`` (a device-plugin
    resource) under an ID none of ``devices`` is offered under: another plugin's, or a device gone
    since; each with the device it is, where its ID is generic-device-plugin's for one of them."""
    devices = list(devices)
    offered = {device.id for device in devices}
    found: list[tuple[Holder, str]] = []
    for pod in pods:
        for container in pod.containers:
            for held in container.devices:
                if held.resource_name != resource.name:
                    continue
                for kubelet_id in held.device_ids:
                    if resource.underlying_id(kubelet_id) not in offered:
                        found.append((Holder(pod.namespace, pod.name, container.name, "device plugin"), kubelet_id))
    if not found:
        return []  # the common case: no hash computed
    known = {gdp_id: device.id for device in devices for gdp_id in generic_device_plugin_ids(device)}
    return [ForeignHold(holder, kubelet_id, known.get(kubelet_id, "")) for holder, kubelet_id in found]


def foreign_holds_report(holds: Iterable[ForeignHold], held_back: bool) -> str:
    """One line for the log: who holds which device under another ID, and what follows. With
    ``held_back``, the devices recognised are reported Unhealthy until their pods end."""
    holds, named, unsafe = list(holds), [], False
    for hold in holds:
        who = f"{hold.holder.namespace}/{hold.holder.pod}/{hold.holder.container}"
        short = hold.kubelet_id if len(hold.kubelet_id) <= 16 else f"{hold.kubelet_id[:12]}…"
        if hold.device_id and held_back:
            named.append(f"{who} holds {hold.device_id} as {short}: Unhealthy here until that pod ends")
        else:
            unsafe = True
            what = f"{hold.device_id}, a share of it" if hold.device_id else "a device this plugin cannot tell"
            named.append(f"{who} holds {short}, {what}")
    advice = (
        ": the kubelet counts only the IDs it gave as in use and may give the same device to another pod: drain "
        "the node, or keep new pods of this resource off it, until they end"
        if unsafe
        else ""
    )
    return (
        f"{_devices(len(holds))} held by running pods under IDs this plugin does not offer (another plugin's, such "
        f"as generic-device-plugin's, or a device gone since): {'; '.join(named)}{advice} "
        "(docs/generic-device-plugin.md: Switching a node from generic-device-plugin)"
    )


def held_back(devices: Any, holds: Iterable[ForeignHold]) -> Any:
    """``devices`` (ID -> DeviceEntry) with each device that ``holds`` name reported Unhealthy, the
    pods holding it in its problem: the kubelet chooses no unhealthy device for a new pod. The
    same object when none is held (or ``devices`` is RETIRED)."""
    if not isinstance(devices, dict):
        return devices
    holders: dict[str, list[str]] = {}
    for hold in holds:
        if hold.device_id in devices:
            holders.setdefault(hold.device_id, []).append(f"{hold.holder.namespace}/{hold.holder.pod}")
    if not holders:
        return devices
    kept = dict(devices)
    for device_id, pods in holders.items():
        problem = f"held by pod {', '.join(dict.fromkeys(pods))} under another plugin's ID, until that pod ends"
        kept[device_id] = dataclasses.replace(devices[device_id], health=UNHEALTHY, problem=problem)
    return kept


########################################################################################################
# 5. purerpc on unix sockets
#
# purerpc speaks gRPC over h2 on anyio streams, but its Server and channels are TCP-only, and its
# connection handler does not fit a long-lived ListAndWatch (_ServerConnection says why). This fence
# keeps purerpc's message framing, HTTP/2 state machine and stream objects, and replaces the socket
# plumbing and the per-connection dispatch. It relies on these purerpc 0.8.x internals (pyproject.toml
# holds purerpc to 0.8.x; h2 3.2 through 4.x, each tested by CI):
#
#   - purerpc.grpc_socket.SocketWrapper: the writer task (_stream, _flush_event), _set_socket_options(stream)
#   - purerpc.grpc_socket.GRPCSocket attributes _grpc_connection, _socket, _receive_buffer_size,
#     _streams, _allocate_stream(stream_id), _listen() (the client's reader loop) and the
#     _reader_thread() task its __aenter__ starts on the client side
#   - purerpc.grpc_socket.GRPCStream: _incoming_events (an anyio memory stream pair), _close_remote(),
#     _flow_control_update_event and _wait_flow_control_update() (its sender waits for a window)
#   - purerpc.grpclib.connection.GRPCConnection: receive_data(), message_read_buffers, h2_connection; the
#     overridden _set_h2_connection_local_settings(), _request_received(), _data_received() and _stream_reset()
#     (stock: none); the MAX_INBOUND_FRAME_SIZE, MAX_CONCURRENT_STREAMS and MAX_HEADER_LIST_SIZE it announces
#   - purerpc.grpclib.buffers.MessageReadBuffer: decompress(data), _message_encoding, _max_message_length
#   - h2 3.2 and 4.x: H2Connection.incoming_buffer, a h2.frame_buffer.FrameBuffer whose iteration
#     (next() in 3.2, __next__() in 4.x), unparsed bytes (data in 3.2, _data in 4.x) and
#     _validate_frame_length() _EarlyLimitFrameBuffer uses; h2.events.PingAckReceived, aliased
#     under the 3.x name PingAcknowledged that purerpc's GRPCConnection names (the imports above)
#   - purerpc's own h2 patches (grpclib/_h2_monkeypatch.py, applied when it is imported) replace
#     H2Connection.data_to_send and clear_outbound_data_buffer with equivalents, and set two
#     stream-state transitions to the values h2 3.2 and 4.x already have: other h2 users in the
#     process see no difference (a test compares them)
#
# Rules for this section: no knowledge of device plugins; everything runs under trio (anyio's trio
# backend underneath purerpc); trio.Cancelled always propagates.
########################################################################################################


class Watched:
    """A value that changes over time, and a way to wait for its next change (any number of waiters)."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self._changed = trio.Event()

    def set(self, value: Any) -> None:
        """Publish a new value if it differs from the current one, waking every waiter."""
        if value != self.value:
            self.value = value
            self.touch()

    def replace(self, value: Any) -> None:
        """Publish ``value`` even if it equals the current one: waiters compare by identity."""
        self.value = value
        self.touch()

    def touch(self) -> None:
        """Wake every waiter, e.g. because something it checks outside the value may have changed."""
        self._changed.set()
        self._changed = trio.Event()

    async def wait_changed(self, seen: Any) -> Any:
        """Return the current value as soon as it is not ``seen`` (compared by identity)."""
        while self.value is seen:
            await self._changed.wait()
        return self.value

    async def wait_touched(self) -> None:
        """Return at the next set() or touch()."""
        await self._changed.wait()

    def next_touch(self) -> trio.Event:
        """The event the next set() or touch() sets: taken now, it cannot miss one that comes later."""
        return self._changed


async def _any_event(events: list[trio.Event], then: trio.Event) -> None:
    """Set ``then`` as soon as any of ``events`` is set."""
    async with trio.open_nursery() as nursery:
        for event in events:

            async def wait(event: trio.Event = event) -> None:
                await event.wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(wait)
    then.set()


async def _any_touched(*watched: Watched) -> None:
    """Return at the next set() or touch() of any of them."""
    events = [one.next_touch() for one in watched]  # before any task switch: no touch is missed
    await _any_event(events, trio.Event())


#: How long a new connection may take to send the HTTP/2 preface and its SETTINGS.
HANDSHAKE_TIMEOUT = 10.0

# One read from the socket. HTTP/2 frames are reassembled by h2, so this bounds the memory and, more,
# the work of one step of the reader: each read is parsed whole before any other task runs (the
# health probe's among them). 16 KiB of PINGs is about 1,000 frames, a few tens of milliseconds of
# h2 in Python; 64 KiB of them kept a probe waiting past its 1 s while a peer flooded. A kubelet's
# request (an Allocate, a ListAndWatch) is a few hundred bytes: one read as before.
_RECEIVE_BUFFER_SIZE = 16 * 1024

# What one peer may make a server hold: a broken or hostile client costs a bounded amount of memory
# and is then refused, and every other client goes on being served. The limits are grpc-go's where
# it has one (the kubelet's side of every call), tighter where grpc-go trusts its peer more than a
# node agent should; docs/security.md, "What a peer can make the plugin hold", lists them all.

#: The most of one request a stream may send before its call ends, in DATA bytes: one message of
#: the largest size the kubelet accepts, and its 5-byte gRPC prefix (grpc-go's server refuses more
#: with RESOURCE_EXHAUSTED). Also the stream's flow-control window that SETTINGS announces: purerpc's
#: two whole messages per stream, never more than one.
MAX_REQUEST_BYTES = KUBELET_MAX_MESSAGE + 5

#: The most request bytes one connection may have unanswered, summed over its streams (counted
#: decompressed). The kubelet's requests are a few hundred bytes; a peer that opens streams and
#: never ends them (a flow-control window on each of 1,024 streams: gigabytes) gets GOAWAY
#: ENHANCE_YOUR_CALM once it passes this.
MAX_CONNECTION_REQUEST_BYTES = KUBELET_MAX_MESSAGE + 2**20

#: How much may wait to be written to one connection before its reader and senders pause until the
#: peer has read it, as grpc-go's writeQuota blocks a sender. The kubelet reads all the time; a
#: peer that does not read costs no more than this and one message in flight.
SEND_QUEUE_LIMIT = 2**17

#: The gRPC message encodings a request may use. The kubelet never compresses, but any gRPC client
#: may: gzip and deflate are decompressed into at most KUBELET_MAX_MESSAGE bytes (more is
#: RESOURCE_EXHAUSTED, as grpc-go), never with the unbounded zlib.decompress purerpc uses (130 KiB
#: of request became 128 MiB). Any other encoding is UNIMPLEMENTED, as grpc-go answers.
DECOMPRESSED_ENCODINGS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}

# Errors that mean "the peer went away". A kubelet that restarts, a probe that exits, a client that
# drops a stream: all normal goodbyes, logged at debug level, never as errors.
_GOODBYE = (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.EndOfStream, ConnectionError)


def _grpc_configuration(client_side: bool) -> GRPCConfiguration:
    # purerpc accepts messages of up to 32 MiB by default; nothing in this API comes near the
    # kubelet's own 4 MiB limit, so neither do we.
    return GRPCConfiguration(client_side=client_side, max_message_length=KUBELET_MAX_MESSAGE)


class _UnixSocketWrapper(SocketWrapper):
    """purerpc's socket wrapper without its TCP options, writing from the task that has the bytes.

    purerpc sets TCP_KEEPIDLE and TCP_NODELAY on every socket. On AF_UNIX they fail with EOPNOTSUPP,
    and purerpc's stock handler swallows the error: the client just times out. A unix socket needs
    none of them (no Nagle, no keepalive: the kernel knows when the peer is gone).

    Stock purerpc sends through a writer task that every flush() wakes: one more trip through
    trio's scheduler per call. Here flush() sends h2's bytes at once from the calling task when the
    writer has nothing in hand (the socket is non-blocking); the writer is kept for what does not
    fit (EAGAIN, a partial send) and for errors. Bytes leave in the order they were flushed.

    ``at_once()`` holds back the sends of a few flushes in a row (a unary answer's headers,
    message and trailers) and sends them together at its end: one send() a call instead of three."""

    _flush_event: anyio.Event  # set by purerpc's constructor; declared for type checkers

    def __init__(self, connection: GRPCConnection, stream: anyio.abc.ByteStream) -> None:
        super().__init__(connection, stream)
        self._outgoing = bytearray()
        self._drained = trio.Event()  # set while everything flushed has been written
        self._drained.set()
        # The socket under anyio's stream (non-blocking, trio made it so); None for another kind of
        # stream (then the writer task sends everything, as stock purerpc does).
        self._raw_socket: socket.socket | None = stream.extra(anyio.abc.SocketAttribute.raw_socket, None)
        self._writer_idle = False  # the writer waits for a flush, nothing in hand
        self._holding = False  # inside at_once(): flushes queue, the send comes at its end
        self._in_hand = 0  # bytes the writer is sending now (taken from _outgoing)

    @staticmethod
    def _set_socket_options(stream: Any) -> None:
        pass

    async def flush(self) -> None:
        data = self._grpc_connection.data_to_send()
        if data:
            self._outgoing += data
            if self._drained.is_set():
                self._drained = trio.Event()
            if not self._holding:
                self._send_now()

    @contextlib.contextmanager
    def at_once(self) -> Iterator[None]:
        """Within: flushes only queue their bytes; on the way out, they are sent in one go. Only
        around code that cannot wait for the peer (nothing it flushes needs the peer to answer
        first, such as a flow-control window), since nothing held is sent before the end."""
        self._holding = True
        try:
            yield
        finally:
            self._holding = False
            if self._outgoing:
                self._send_now()

    def _send_now(self) -> None:
        """Send what is queued from this task if the writer is idle; else (or for what remains) wake it."""
        if self._writer_idle and self._raw_socket is not None:
            try:
                sent = self._raw_socket.send(self._outgoing)
            except OSError:  # EAGAIN: the buffer is full; or the peer is gone: the writer finds out
                sent = 0
            del self._outgoing[:sent]
            if not self._outgoing:
                self._drained.set()
                return
        self._flush_event.set()

    async def recv(self, buffer_size: int) -> bytes:
        """The next bytes from the peer: wait until the socket is readable, then read once.

        anyio's receive tries the read first, and trio yields to its scheduler after a read that
        succeeded; after a call's request, the next read finds nothing (EAGAIN) and waits too: two
        passes through the scheduler per request, where waiting first costs one. The errors are
        anyio's, as its receive raises them."""
        raw = self._raw_socket
        if raw is None:
            received: bytes = await super().recv(buffer_size)
            return received
        while True:
            try:
                await trio.lowlevel.wait_readable(raw)  # a checkpoint: cancellation as ever
                data = raw.recv(buffer_size)
            except BlockingIOError:
                continue  # readable, and yet nothing (another reader, a spurious wake): wait again
            except trio.ClosedResourceError:  # closed by another task while we waited
                raise anyio.ClosedResourceError from None
            except OSError as error:  # ECONNRESET and the like; EBADF: closed under us
                raise anyio.BrokenResourceError from error
            if not data:
                raise anyio.EndOfStream
            return data

    async def drained(self) -> None:
        """Return once everything flushed so far has been written to the socket."""
        await self._drained.wait()

    def backlog(self) -> int:
        """Bytes flushed and not yet written to the socket."""
        return len(self._outgoing) + self._in_hand

    async def room(self) -> None:
        """Return at once while less than SEND_QUEUE_LIMIT waits to be written, else once all of it
        is (the peer read it): what a sender awaits before making more to send. O(1)."""
        if len(self._outgoing) + self._in_hand > SEND_QUEUE_LIMIT:
            await self._drained.wait()

    async def _writer_thread(self) -> None:
        try:
            while True:
                if self._outgoing:
                    data = bytes(self._outgoing)
                    self._outgoing.clear()
                    self._in_hand = len(data)
                    await self._stream.send(data)
                    self._in_hand = 0
                elif self._running:
                    self._drained.set()
                    self._writer_idle = True
                    try:
                        await self._flush_event.wait()
                    finally:
                        self._writer_idle = False
                    self._flush_event = anyio.Event()
                else:
                    return
        finally:
            self._drained.set()  # nothing more will be written: nobody should wait for it


class _EarlyLimitFrameBuffer(h2.frame_buffer.FrameBuffer):
    """h2's frame reassembly, refusing an overlong frame as soon as its 9-byte header arrives:
    h2 checks a frame's length only once the whole frame is buffered (a 16 MiB frame: 16 MiB held).
    A frame header starts with the payload length, 24 bits big-endian (RFC 9113, section 4.1)."""

    def __next__(self) -> Any:
        # The bytes not yet parsed: `_data` in h2 4.x, `data` in h2 3.2 (empty either way: b"").
        buffered = getattr(self, "_data", b"") or getattr(self, "data", b"")
        if len(buffered) >= 9:
            # FrameTooLargeError: h2 sends GOAWAY, and the connection is closed
            self._validate_frame_length(int.from_bytes(buffered[:3], "big"))
        return super().__next__()  # h2 3.2's __next__ calls its next(), which does the parsing


class _ResetAwareConnection(GRPCConnection):
    """purerpc's gRPC-over-h2 state machine, reporting RST_STREAM instead of dropping it.

    A client cancels one call by sending RST_STREAM on that stream only. Stock purerpc ignores it,
    so a ListAndWatch handler would live on until its next push tried to write, forever if none came."""

    # What we announce in SETTINGS. purerpc offers 2^24-1 byte frames: a peer could make us buffer
    # 16 MiB per frame. The kubelet's grpc-go sends 16 KiB frames (the HTTP/2 default).
    MAX_INBOUND_FRAME_SIZE = 2**14
    # The kubelet makes every call to a plugin on one connection, and grpc-go queues a call over
    # the streams we allow until one ends, its deadline running: with 32 streams, 32 slow pre_start
    # commands would time out the PreStartContainer and Allocate calls behind them. So: far more
    # streams than a kubelet can have in flight (110 pods per node by default); how much work runs
    # at once is for the handlers to limit. purerpc's own 65,536 would let a peer pile up more.
    MAX_CONCURRENT_STREAMS = 1024

    def __init__(self, config: GRPCConfiguration) -> None:
        super().__init__(config)
        self.h2_connection.incoming_buffer.__class__ = _EarlyLimitFrameBuffer
        #: Request bytes received on each stream whose call has not ended (MAX_REQUEST_BYTES), and
        #: their sum (MAX_CONNECTION_REQUEST_BYTES); _ServerConnection.release() forgets a stream's.
        self.pending: dict[int, int] = {}
        self.buffered = 0

    def _set_h2_connection_local_settings(self) -> None:
        # purerpc's, but for the window: purerpc opens two whole messages' worth on every stream,
        # a request is one (MAX_REQUEST_BYTES).
        self.h2_connection.local_settings = h2.settings.Settings(
            client=self.config.client_side,
            initial_values={
                h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: self.MAX_CONCURRENT_STREAMS,
                h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: MAX_REQUEST_BYTES,
                h2.settings.SettingCodes.MAX_FRAME_SIZE: self.MAX_INBOUND_FRAME_SIZE,
                h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: self.MAX_HEADER_LIST_SIZE,
            },
        )
        self.h2_connection.max_inbound_frame_size = self.MAX_INBOUND_FRAME_SIZE

    def _request_received(self, event: h2.events.RequestReceived) -> list[Any]:
        # purerpc's, but for the buffer: its messages decompressed within bounds (_BoundedReadBuffer).
        if event.stream_ended:
            raise ProtocolError("Stream ended before data was sent")
        request = RequestReceived.parse_from_stream_id_and_headers_destructive(
            event.stream_id, HeaderDict(event.headers)
        )
        self.message_read_buffers[event.stream_id] = _BoundedReadBuffer(request.message_encoding, KUBELET_MAX_MESSAGE)
        return [request]

    def _data_received(self, event: h2.events.DataReceived) -> list[Any]:
        """One DATA frame of a request: counted against MAX_REQUEST_BYTES and the connection's
        MAX_CONNECTION_REQUEST_BYTES (two additions and a comparison each), then parsed into messages.
        A stream over its limit, or whose message cannot be decompressed, is refused (_Refused)."""
        stream_id, size = event.stream_id, event.flow_controlled_length
        buffer = self.message_read_buffers.get(stream_id)
        if buffer is None:  # the rest of a request refused in this same batch: dropped, the window given back
            self.h2_connection.acknowledge_received_data(size, stream_id)
            return []
        stream_total = self.pending.get(stream_id, 0) + size
        self.pending[stream_id] = stream_total
        self.buffered += size
        if self.buffered > MAX_CONNECTION_REQUEST_BYTES:
            raise _PeerOverLimitError(
                f"{self.buffered} bytes of requests not yet answered, over the limit of {MAX_CONNECTION_REQUEST_BYTES}"
            )
        if stream_total > MAX_REQUEST_BYTES:
            why = f"received request larger than max ({stream_total} vs. {MAX_REQUEST_BYTES} bytes)"
            return self._refuse(stream_id, StatusCode.RESOURCE_EXHAUSTED, why)
        try:
            buffer.data_received(event.data, size)
            messages = buffer.read_all_complete_messages_flowcontrol()
        except MessageTooLargeError as error:
            return self._refuse(stream_id, StatusCode.RESOURCE_EXHAUSTED, str(error))
        except UnsupportedMessageEncodingError as error:
            return self._refuse(stream_id, StatusCode.UNIMPLEMENTED, str(error))
        except zlib.error as error:
            return self._refuse(stream_id, StatusCode.INTERNAL, f"cannot decompress the message: {error}")
        events = []
        for message, length in messages:
            if len(message) > length:  # decompressed: what it holds now counts
                self.pending[stream_id] += len(message) - length
                self.buffered += len(message) - length
                if self.buffered > MAX_CONNECTION_REQUEST_BYTES:
                    raise _PeerOverLimitError(
                        f"{self.buffered} bytes of requests (decompressed) not yet answered, "
                        f"over the limit of {MAX_CONNECTION_REQUEST_BYTES}"
                    )
            events.append(MessageReceived(stream_id, message, length))
        return events

    def _refuse(self, stream_id: int, code: int, message: str) -> list[Any]:
        """Stop reading a request: its bytes are dropped, and the call is answered ``code``."""
        del self.message_read_buffers[stream_id]
        return [_Refused(stream_id, Status(code, message))]

    def _stream_reset(self, event: h2.events.StreamReset) -> list[Any]:
        return [event]


class _BoundedReadBuffer(MessageReadBuffer):
    """purerpc's message reassembly, decompressing into at most ``max_message_length`` bytes."""

    def decompress(self, data: bytes) -> bytes:
        encoding = self._message_encoding
        if encoding not in DECOMPRESSED_ENCODINGS:
            raise UnsupportedMessageEncodingError(f"grpc: decompressor is not installed for grpc-encoding {encoding!r}")
        decompressor = zlib.decompressobj(DECOMPRESSED_ENCODINGS[encoding])
        limit = self._max_message_length
        # In pieces of 256 KiB: one call with a max_length grows its output buffer by doubling, to
        # twice the limit for a message that passes it.
        pieces, size = [], 0
        while data and not decompressor.eof:
            piece = decompressor.decompress(data, 2**18)
            data = decompressor.unconsumed_tail
            size += len(piece)
            if size > limit:
                raise MessageTooLargeError(
                    f"grpc: received message after decompression larger than max (over {limit} bytes)"
                )
            pieces.append(piece)
        if not decompressor.eof:
            raise zlib.error("the compressed data ends early")
        return b"".join(pieces)


@dataclass(frozen=True)
class _Refused:
    """A gRPC event of ours: the request on ``stream_id`` is refused with ``status`` before it is complete."""

    stream_id: int
    status: Status


class _PeerOverLimitError(ProtocolError):
    """A peer passed one of its connection's limits: the connection is closed with GOAWAY ENHANCE_YOUR_CALM."""


class _GRPCSocket(GRPCProtoSocket):
    """A purerpc connection on any anyio byte stream (here: a unix socket), client or server side."""

    def __init__(self, stream: anyio.abc.ByteStream, connection: GRPCConnection) -> None:
        # GRPCSocket.__init__ would wrap the stream in the stock SocketWrapper (the TCP options).
        AsyncExitStack.__init__(self)
        self._grpc_connection = connection
        self._socket = _UnixSocketWrapper(connection, stream)
        self._receive_buffer_size = _RECEIVE_BUFFER_SIZE
        self._streams: dict[int, GRPCProtoStream] = {}

    async def _reader_thread(self) -> None:
        # Client side only. Stock purerpc returns quietly at end of file, every open call left
        # waiting forever: end them (their receivers see EndOfStream).
        try:
            async for _ in self._listen():
                raise ProtocolError("the server sent a request")
        except Exception as error:
            log.debug("client connection ended: %s", _describe(error))
        finally:
            for stream in self._streams.values():
                stream._incoming_events[0].close()


def _close_event_queues(stream: GRPCProtoStream) -> None:
    """Close the memory streams purerpc opens per call and never closes (else: ResourceWarning)."""
    for end in stream._incoming_events:
        end.close()


class _ImmediateService(purerpc.Service):
    """A purerpc service that can also hold *immediate* unary methods: handlers that never wait.

    Most of what the kubelet asks a device plugin is answered from what the plugin already knows
    (Allocate, GetPreferredAllocation, GetDevicePluginOptions). A call answered in its own task
    costs a task, a cancel scope, two memory streams and an event before its handler runs a line:
    over half of the work of a whole Allocate. An immediate method's handler is a plain function,
    run by the connection's reader once the request is complete, its answer handed to h2 directly
    (_ServerConnection._answer_now). It cannot wait (it is no coroutine), so no other call is held
    up behind it longer than its own computing takes (one that may wait returns an async function: a task awaits it).

    To any other server (stock purerpc's), an immediate method is an ordinary async one."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        #: The immediate handlers, by method name: (handler, request type).
        self.immediate: dict[str, tuple[Callable[[Any], Any], Any]] = {}

    def add_immediate_method(
        self, method_name: str, handler: Callable[[Any], Any], signature: purerpc.RPCSignature
    ) -> None:
        """Add a unary method answered by ``handler(request) -> response``, which never waits."""
        if signature.cardinality != purerpc.Cardinality.UNARY_UNARY:
            raise ValueError(f"{self.name}/{method_name}: only a unary method can be immediate")

        async def method(request: Any) -> Any:
            return await response() if callable(response := handler(request)) else response

        self.add_method(method_name, method, signature)
        self.immediate[method_name] = (handler, signature.request_type)


class _ServerConnection(_GRPCSocket):
    """One accepted connection: reads frames, runs each call in its own task and cancel scope, or
    answers it at once when its method is immediate (_ImmediateService: no task, no scope).

    Every method here takes exactly one request message, so a call starts once its request is
    complete (END_STREAM seen): a unary call runs from request to response in one scheduler step.

    Every call's trio.CancelScope is kept in ``calls`` until its task ends: RST_STREAM cancels that
    one (or drops a request still arriving), end of file cancels them all. Reset streams are removed
    from purerpc's stream table, which only forgets streams that ended normally both ways.

    A handler's RPCError becomes the call's status; any other exception is logged with its
    traceback and answered UNKNOWN. Malformed HTTP/2 or gRPC raises out of serve()."""

    def __init__(
        self,
        stream: anyio.abc.ByteStream,
        services: Mapping[str, purerpc.Service],
        on_call_end: Callable[[], None] = lambda: None,
    ) -> None:
        super().__init__(stream, _ResetAwareConnection(_grpc_configuration(client_side=False)))
        self._services = services
        self._on_call_end = on_call_end
        #: Calls in progress on this connection, by HTTP/2 stream id.
        self.calls: dict[int, trio.CancelScope] = {}
        #: Requests still arriving: their headers and the messages so far, by HTTP/2 stream id.
        self._requests: dict[int, tuple[RequestReceived, list[bytes]]] = {}
        #: The immediate methods (_ImmediateService) by (service, method) name, answered by _answer_now.
        self._immediate = {
            (service_name, method_name): answer
            for service_name, service in services.items()
            for method_name, answer in getattr(service, "immediate", {}).items()
        }

    @property
    def open_streams(self) -> int:
        """Streams purerpc still tracks on this connection (0 once every call is over)."""
        return len(self._streams) + len(self._grpc_connection.message_read_buffers)

    async def serve(self) -> None:
        """Answer calls until the peer closes the connection, then cancel whatever is still running."""
        # A peer must finish the HTTP/2 greeting (preface, then SETTINGS) in time; afterwards a
        # connection may stay silent for months (the kubelet's ListAndWatch stream does).
        greeting_deadline = trio.current_time() + HANDSHAKE_TIMEOUT
        async with trio.open_nursery() as nursery:
            while True:
                with trio.move_on_at(greeting_deadline) as waiting:
                    # A peer that does not read what we answer is not read from (SEND_QUEUE_LIMIT):
                    # its requests, pings and settings wait in its socket, not in our memory.
                    if self._socket.backlog() > SEND_QUEUE_LIMIT:
                        await self._socket.room()
                    try:
                        data = await self._socket.recv(self._receive_buffer_size)
                    except (anyio.EndOfStream, anyio.BrokenResourceError):
                        break
                if waiting.cancelled_caught:
                    log.debug("no HTTP/2 greeting within %g s: connection closed", HANDSHAKE_TIMEOUT)
                    break
                try:
                    events = self._grpc_connection.receive_data(data)  # raises on malformed input
                except _PeerOverLimitError as error:
                    log.warning("a client of this plugin's socket was disconnected: %s", error)
                    self._grpc_connection.h2_connection.close_connection(
                        h2.errors.ErrorCodes.ENHANCE_YOUR_CALM, str(error).encode()
                    )
                    await self._socket.flush()  # the GOAWAY, if the peer's socket has room for it
                    break
                except h2.exceptions.ProtocolError as error:
                    # h2 has queued the GOAWAY that names the error (FLOW_CONTROL_ERROR for a window
                    # past 2^31-1, PROTOCOL_ERROR, ...): send it, as RFC 9113 section 5.4.1 asks, then close.
                    log.debug("closed a connection that broke HTTP/2: %s", _describe(error))
                    await self._socket.flush()
                    break
                if events:  # the peer's SETTINGS came through: greeted
                    greeting_deadline = math.inf
                reset = self._dispatch(events, nursery)
                await self._socket.flush()  # a SETTINGS ack, a PING reply, WINDOW_UPDATEs...
                # Only now, with the whole batch dispatched, forget the reset streams: an event of
                # the same batch may still have named them.
                for stream_id in reset:
                    if (stream := self._streams.pop(stream_id, None)) is not None:
                        _close_event_queues(stream)  # (a call's task closes them too: no matter)
                    self._grpc_connection.message_read_buffers.pop(stream_id, None)
            # The peer is gone, and with it every answer we could send: end every call now.
            nursery.cancel_scope.cancel()

    def _dispatch(self, events: list[Any], nursery: trio.Nursery) -> list[int]:
        """Hand one batch of events to their calls, starting new ones; return the reset stream ids.

        Synchronous on purpose: the batch is applied as a whole, no other task runs in between."""
        reset = []
        # A call reset in the batch that completes its request is not started at all: its handler
        # would run anyway, up to its first checkpoint, for a stream h2 has closed already.
        cancelled = {event.stream_id for event in events if isinstance(event, h2.events.StreamReset)}
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
                    scope.cancel()  # the call's task releases its bytes as it ends
                elif self._requests.pop(event.stream_id, None) is not None:
                    self.release(event.stream_id)
                reset.append(event.stream_id)
            elif isinstance(event, _Refused):
                self._requests.pop(event.stream_id, None)
                self.release(event.stream_id)
                reset.append(event.stream_id)  # its purerpc stream, if any, is forgotten as a reset one's
                self._refuse(event)
            elif isinstance(event, RequestReceived):
                if len(self._requests) + len(self.calls) >= _ResetAwareConnection.MAX_CONCURRENT_STREAMS:
                    # h2 enforces our SETTINGS only once the peer acknowledged them: until then, this.
                    raise _PeerOverLimitError(f"more than {len(self._requests) + len(self.calls)} streams at once")
                if (event.service_name, event.method_name) not in self._immediate:
                    self._allocate_stream(event.stream_id)  # answered by _answer_now: none needed
                self._requests[event.stream_id] = (event, [])
            elif isinstance(event, MessageReceived):
                # Give the bytes back to the peer's flow-control window (sent by the next flush),
                # or after enough requests it could not send us anything more.
                self._grpc_connection.acknowledge_received_data(event.stream_id, event.flow_controlled_length)
                if (request := self._requests.get(event.stream_id)) is not None and len(request[1]) < 2:
                    request[1].append(event.data)  # two already make it wrong: keep no more
            elif isinstance(event, RequestEnded):
                request = self._requests.pop(event.stream_id, None)
                if request is None or event.stream_id in cancelled:
                    self.release(event.stream_id)
                    continue  # a late frame of a reset call, or reset already: serve() forgets it
                answer = self._immediate.get((request[0].service_name, request[0].method_name))
                if answer is not None:
                    self._answer_now(answer, *request, nursery)
                    self.release(event.stream_id)  # (a call _answer_now started in a task releases again: no matter)
                elif (stream := self._streams.get(event.stream_id)) is not None:
                    self._start_call(stream, request[0], request[1], nursery)
        return reset

    def release(self, stream_id: int) -> None:
        """Forget the request bytes a stream holds (its call ended, or it never will run)."""
        connection = self._grpc_connection
        connection.buffered -= connection.pending.pop(stream_id, 0)

    def _refuse(self, refused: _Refused) -> None:
        """Answer a refused request with its status at once, then ask the peer to stop sending the
        rest of it: RST_STREAM NO_ERROR after a complete response, as RFC 9113 section 8.1 lets a
        server (and grpc-go does)."""
        connection = self._grpc_connection
        try:
            connection.respond_status(refused.stream_id, refused.status)
            connection.reset_stream(refused.stream_id, h2.errors.ErrorCodes.NO_ERROR)
        except h2.exceptions.ProtocolError as error:  # the request had ended: closed both ways already
            log.debug("refused stream %d: %r", refused.stream_id, error)

    def _start_call(
        self,
        stream: GRPCProtoStream,
        request: RequestReceived,
        messages: list[bytes],
        nursery: trio.Nursery,
        response: Any = None,
    ) -> None:
        stream._close_remote()
        scope = self.calls[stream.stream_id] = trio.CancelScope()

        async def run_call() -> None:
            try:
                with scope:
                    await _answer_call(self._services, stream, request, messages, response)
            finally:
                del self.calls[stream.stream_id]
                self.release(stream.stream_id)
                _close_event_queues(stream)
                self._on_call_end()

        nursery.start_soon(run_call)

    def _answer_now(
        self,
        answer: tuple[Callable[[Any], Any], Any],
        request: RequestReceived,
        messages: list[bytes],
        nursery: trio.Nursery,
    ) -> None:
        """Answer a call to an immediate method (_ImmediateService) here, in the reader's task, its
        response handed to h2 as HEADERS, DATA and trailing HEADERS: serve() sends them with the
        rest of the batch's bytes, in one write. What the handler returns and raises becomes the same frames a
        call in its own task would send (_answer_call), and is logged the same way."""
        handler, request_type = answer
        stream_id = request.stream_id
        connection = self._grpc_connection
        try:
            with _held_back("grpc", f"{request.service_name}/{request.method_name}", _unknown):
                response = handler(_request_message(request_type, messages))
        except RPCError as error:
            status = Status(error.code, error.message)
        else:
            window = connection.flow_control_window(stream_id)
            if callable(response) or 5 + len(message := response.SerializeToString()) > window:
                # An answer to wait for, or more than the peer lets us send now (its window, or one frame):
                # purerpc's stream sends it as the window opens. Either takes a task that can wait.
                self._start_call(self._allocate_stream(stream_id), request, messages, nursery, response)
                return
            status = Status(StatusCode.OK)
            try:
                # A gRPC message: no compression (0), its length (4 bytes, big-endian), the protobuf.
                connection.start_response(stream_id, "+proto")
                connection.send_data(stream_id, b"\0" + len(message).to_bytes(4, "big") + message)
                connection.end_response(stream_id, status)
            except h2.exceptions.ProtocolError as error:  # reset by the peer in this very batch
                log.debug("could not answer stream %d: %r", stream_id, error)
            return
        # A status alone, as purerpc's close() sends it for a call that sent no message.
        try:
            connection.respond_status(stream_id, status)
        except h2.exceptions.ProtocolError as error:
            log.debug("could not close stream %d: %r", stream_id, error)


_unknown = functools.partial(RPCError, StatusCode.UNKNOWN)  # a handler's bug (_held_back), as grpc-go's panic


def _request_message(request_type: Any, messages: list[bytes]) -> Any:
    """The one request message of a call (every method here takes exactly one), parsed."""
    if len(messages) != 1:  # grpc-go answers INTERNAL too
        got = "none" if not messages else "more than one"
        raise RPCError(StatusCode.INTERNAL, f"expected one request message, got {got}")
    try:
        return request_type.FromString(messages[0])
    except DecodeError as error:
        raise RPCError(StatusCode.INTERNAL, f"cannot parse the request: {error}") from None


async def _answer_call(
    services: Mapping[str, purerpc.Service],
    stream: GRPCProtoStream,
    request: RequestReceived,
    messages: list[bytes],
    response: Any = None,
) -> None:
    """Run one call: find its handler, feed it the request, send what it returns, close with a status.
    ``response``: a unary call's response already made (_answer_now's, too big to send at once), or to await."""
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
        with _held_back("grpc", f"{request.service_name}/{request.method_name}", _unknown):
            if response is None:
                message = _request_message(bound.signature.request_type, messages)
            if bound.signature.cardinality == purerpc.Cardinality.UNARY_UNARY:
                if response is None or callable(response):  # (callable: an immediate method's that waits)
                    response = await (response or functools.partial(bound.method_fn, message, request=request))()
                with _at_once_if_it_fits(stream, response):
                    await stream.start_response()
                    await stream.send_message(response)
                    await _close_stream(stream, Status(StatusCode.OK))
                return
            else:
                await stream.start_response()
                responses = bound.method_fn(message, request=request)
                try:
                    async for response in responses:
                        await _send_in_frames(stream, response.SerializeToString())
                finally:
                    # Runs the handler's own `finally` now, even when we were cancelled mid-stream.
                    with trio.CancelScope(shield=True):
                        await responses.aclose()
        status = Status(StatusCode.OK)
    except RPCError as error:
        status = Status(error.code, error.message)
    await _close_stream(stream, status)


async def _send_in_frames(stream: GRPCProtoStream, data: bytes) -> None:
    """Send a message as purerpc's _send does, but from ``data`` itself (the list all streams share;
    purerpc copies it per stream), 16 KiB at a time (whatever frames the peer allows), each once the
    queue has room: a peer that opened its windows and never reads holds SEND_QUEUE_LIMIT."""
    connection, view = stream._grpc_connection, memoryview(b"\0" + len(data).to_bytes(4, "big"))
    for piece in (view, memoryview(data)):
        while piece:
            if stream._socket.backlog() > SEND_QUEUE_LIMIT:
                await stream._socket.room()  # a peer that does not read gets nothing more queued
            if (window := min(connection.flow_control_window(stream.stream_id), 2**14)) <= 0:
                await stream._wait_flow_control_update()
                continue
            connection.send_data(stream.stream_id, piece[:window])
            piece = piece[window:]
            await stream._socket.flush()


async def _close_stream(stream: GRPCProtoStream, status: Status) -> None:
    """End a call with its status (the trailers)."""
    try:
        await stream.close(status)
    except Exception as error:  # the peer reset the stream while we were finishing
        log.debug("could not close stream %d: %r", stream.stream_id, error)


def _at_once_if_it_fits(stream: GRPCProtoStream, response: Any) -> contextlib.AbstractContextManager[None]:
    """Within it, a unary answer's headers, message and trailers leave in one send (at_once), if
    the message fits in what the peer lets us send now (its flow-control window, the stream's and
    the connection's): otherwise purerpc must send part of it and wait for the peer to open the
    window, which held-back bytes would never make it do. A gRPC message is 5 bytes of framing
    and the protobuf."""
    socket = stream._socket
    if isinstance(socket, _UnixSocketWrapper):
        try:
            window = stream._grpc_connection.flow_control_window(stream.stream_id)
        except Exception:  # the stream is gone already: the ordinary path says so as before
            window = 0
        if 5 + response.ByteSize() <= window:
            return socket.at_once()
    return contextlib.nullcontext()


@dataclass
class GRPCServer:
    """What ``serve_grpc`` reports once it listens: its socket and what is live on it."""

    socket_path: str  #: the unix socket the server listens on
    identity: tuple[int, int, int]  #: the socket file's _identity(): ours, or one created later at that path
    connections: set[_ServerConnection]  #: connections open right now
    calls_ended: Watched  #: touched whenever a call or a connection ends (then see live_calls, connections)

    def owns_socket_file(self) -> bool:
        """Whether the socket file is still ours: not deleted, not replaced by another file."""
        return _identity(self.socket_path) == self.identity

    @property
    def live_calls(self) -> int:
        """Calls being answered right now, over all connections."""
        return sum(len(connection.calls) for connection in self.connections)

    @property
    def open_streams(self) -> int:
        """Stream entries purerpc still holds, over all connections (0 when all calls are over)."""
        return sum(connection.open_streams for connection in self.connections)

    async def drained(self) -> None:
        """Return once every connection has written all it was given to send."""
        for connection in list(self.connections):
            await connection._socket.drained()


async def serve_grpc(
    socket_path: str,
    services: Iterable[purerpc.Service],
    *,
    task_status: trio.TaskStatus[GRPCServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve purerpc services on a unix socket until cancelled.

    Creates the socket (replacing a stale socket file at that path) with mode 0600, and calls
    ``task_status.started(GRPCServer)`` once it is listening. Each connection runs in its own task;
    the socket file is removed on the way out, unless someone else replaced it (_identity). A
    connection that breaks the protocol is dropped with a debug line; errors creating the socket
    propagate to the caller."""
    by_name = {service.name: service for service in services}
    listener = await anyio.create_unix_listener(socket_path, mode=0o600)
    try:
        identity = _identity(socket_path)
        if identity is None:
            raise FileNotFoundError(errno.ENOENT, "deleted as soon as it was made", socket_path)
        server = GRPCServer(socket_path, identity, set(), Watched(None))
    except OSError:
        await listener.aclose()  # the file went already (a kubelet wiping its directory)
        raise
    async with listener, trio.open_nursery() as nursery:
        try:
            task_status.started(server)
            while True:
                stream = await _accept(listener, socket_path)
                nursery.start_soon(_serve_connection, stream, by_name, server)
        finally:
            # At once, before the connections' tasks are waited for: one that does not end at once
            # (a call waiting for a thread) must not leave a socket behind that nobody accepts on.
            _remove_socket_file(server)


#: How long to wait before accepting again when the process is out of file descriptors (trio's
#: own serve_listeners waits as long): the connections waiting in the backlog are not lost.
ACCEPT_RETRY_INTERVAL = 0.1

# accept() errors that mean "out of a resource for now", not "this socket is broken".
_ACCEPT_CAPACITY_ERRORS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}


async def _accept(listener: anyio.abc.SocketListener, socket_path: str) -> anyio.abc.ByteStream:
    """The next connection. Running out of file descriptors (each connection takes one) must not
    stop the server: say so once, and retry until a descriptor is free again."""
    short_of = ""
    while True:
        try:
            stream = await listener.accept()
        except (OSError, anyio.BrokenResourceError) as error:
            cause = error if isinstance(error, OSError) else error.__cause__  # anyio wraps the OSError
            if not isinstance(cause, OSError) or cause.errno not in _ACCEPT_CAPACITY_ERRORS:
                raise
            if not short_of:
                short_of = os.strerror(cause.errno or 0)
                log.error(
                    "cannot accept connections on %s: %s (raise the open-files limit: ulimit -n, LimitNOFILE, "
                    "or the container runtime's default); retrying every %g s",
                    socket_path,
                    short_of,
                    ACCEPT_RETRY_INTERVAL,
                )
            await trio.sleep(ACCEPT_RETRY_INTERVAL)
            continue
        if short_of:
            log.warning("accepting connections on %s again", socket_path)
        return stream


def _remove_socket_file(server: GRPCServer) -> None:
    # Gone already: a restarting kubelet removes every socket in its directory. Replaced: not ours.
    if server.owns_socket_file():
        with contextlib.suppress(FileNotFoundError):
            os.unlink(server.socket_path)


def _accepts(socket_path: str) -> bool:
    """Whether something listens on a unix socket (a connection is made and closed at once)."""
    with socket.socket(socket.AF_UNIX) as probe_socket:
        probe_socket.settimeout(1.0)
        try:
            probe_socket.connect(socket_path)
            return True
        except OSError:
            return False


def _inode(path: str) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def _identity(path: str) -> tuple[int, int, int] | None:
    """Which file is at ``path`` now: device, inode and change time. The inode alone is not enough:
    a file deleted and another created in its place often get the same inode number."""
    try:
        status = os.stat(path)
    except OSError:
        return None
    return status.st_dev, status.st_ino, status.st_ctime_ns


#: The running plugin's metrics, or None when metrics are off (the hooks then do nothing).
_metrics: Metrics | None = None


@contextlib.contextmanager
def _held_back(
    kind: str,
    what: str,
    refusal: Callable[[str], Exception] | None = None,
    logger: logging.Logger | logging.LoggerAdapter[logging.Logger] | None = log,
) -> Iterator[None]:
    """The rule at every boundary: nothing a file, a program, the kubelet, the API server or a peer
    sends ends the process. An error in the block that is no refusal (GopherplugError) is a bug that
    input ``what`` met, and still its refusal: one line, to ``logger`` (None: the caller's refusal
    path says it), raised as ``refusal(line)`` for that path to keep what runs (the last good
    configuration, the devices as known), or without ``refusal`` the block's effect not had. Its
    traceback is logged at debug; gopherplug_unexpected_errors counts it by ``kind``."""
    try:
        yield
    except Exception as error:
        if isinstance(_innermost(error), GopherplugError):
            raise
        line = (
            f"{what}{': ' if what else ''}{type(_innermost(error)).__name__}: {_describe(error)}: held back; "
            "a bug in gopherplug, please report it (its traceback is logged at log level debug)"
        )
        if _metrics is not None:
            _metrics.unexpected.labels(kind).inc()
        if logger is not None:
            logger.error("%s", line)
        log.debug("the bug's traceback:", exc_info=True)
        if refusal is not None:
            raise refusal(line) from error


def _release_freed_memory() -> None:
    """Give the memory that start-up freed back to the kernel, where the C library can.

    A start without bytecode (a copy of this file in a read-only image, or PYTHONDONTWRITEBYTECODE)
    compiles the module: about 13 MiB of syntax tree and compiler state, freed once the module
    exists, which glibc's malloc keeps in its heap for reuse that never comes, so it would stay
    in the process's RSS for its whole life. malloc_trim(0) returns free heap pages to the
    kernel (glibc only: other C libraries have no such call). From bytecode it finds little."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


async def _serve_connection(
    stream: anyio.abc.ByteStream, services: Mapping[str, purerpc.Service], server: GRPCServer
) -> None:
    connection = _ServerConnection(stream, services, server.calls_ended.touch)
    connections = server.connections
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
        server.calls_ended.touch()
        if connection._socket.backlog():  # a peer left that did not read all it was sent: what its
            _release_freed_memory()  # queue held goes back to the kernel, not kept by malloc for good


@contextlib.contextmanager
def _unwrap_single_errors() -> Iterator[None]:
    """Raise the lone exception inside an exception group as itself: anyio's task groups (inside
    purerpc's sockets) wrap even the caller's own RPCError leaving an ``async with`` in one."""
    try:
        yield
    except BaseExceptionGroup as group:
        error = _innermost(group)
        if error is group:
            raise
        raise error from None


@asynccontextmanager
async def _client_connection(socket_path: str) -> AsyncIterator[_GRPCSocket]:
    """Connect to a unix socket and speak HTTP/2 on it; close the socket on the way out."""
    stream = await anyio.connect_unix(socket_path)
    async with stream, _GRPCSocket(stream, GRPCConnection(_grpc_configuration(client_side=True))) as grpc_socket:
        yield grpc_socket


@asynccontextmanager
async def _request(
    grpc_socket: _GRPCSocket,
    method: Method,
    request: Any,
    metadata: tuple[tuple[str, str], ...],
    timeout: datetime.timedelta | None = None,
) -> AsyncIterator[GRPCProtoStream]:
    """Start a call of ``method`` on a client connection, send its one request, and yield its stream."""
    service, _, name = method.path[1:].partition("/")
    full_name = method.request_type.DESCRIPTOR.full_name
    # ``:authority: localhost``, what the kubelet sends; purerpc's channel would send "host:port".
    stream = await grpc_socket.start_request(
        "http", service, name, full_name, authority="localhost", timeout=timeout, custom_metadata=metadata
    )
    try:
        stream.expect_message_type(method.response_type)
        await stream.send_message(request)
        await stream.close()
        yield stream
    finally:
        _close_event_queues(stream)


async def call_unary(
    socket_path: str, method: Method, request: Any, *, timeout: float, metadata: tuple[tuple[str, str], ...] = ()
) -> Any:
    """Make one unary call on a unix socket, the way grpc-go (the kubelet) does, and return the answer.

    Sends a grpc-timeout header, and gives up after ``timeout`` seconds: a server that accepts but
    never answers would hang the caller. A fresh connection per call (Register, probes: rare).

    Raises RPCError: the server's status if it answered with one, UNAVAILABLE if the socket could
    not be reached or the connection broke, DEADLINE_EXCEEDED if no answer came in time.
    ``metadata``: request headers, (name, value) pairs."""
    # Whole seconds: grpc-go rejects a timeout of more than 8 digits, which purerpc's microsecond
    # unit reaches at 100 s.
    deadline = datetime.timedelta(seconds=math.ceil(timeout))
    try:
        with trio.fail_after(timeout):
            async with _client_connection(socket_path) as grpc_socket:
                async with _request(grpc_socket, method, request, metadata, deadline) as stream:
                    return await extract_message_from_singleton_stream(stream)
    except trio.TooSlowError:
        raise RPCError(
            StatusCode.DEADLINE_EXCEEDED, f"{method.path} on {socket_path}: no answer within {timeout:g} s"
        ) from None
    except Exception as group:
        error = _innermost(group)
        if isinstance(error, RpcFailedError):
            raise RPCError(error.status.status_code, error.status.status_message) from None
        # A peer that accepts and hangs up: anyio's EndOfStream, BrokenResourceError or both in a group
        # tell a user nothing. (A refused connection is a ConnectionError too, and says so itself.)
        hung_up = (*_GOODBYE[:3], BrokenPipeError, ConnectionResetError)
        if isinstance(error, hung_up) or (isinstance(group, ExceptionGroup) and group.split(hung_up)[1] is None):
            error = ConnectionError("the server closed the connection before it answered")
        raise RPCError(StatusCode.UNAVAILABLE, f"{method.path} on {socket_path}: {_describe(error)}") from error
    except BaseExceptionGroup as group:
        # The caller was cancelled while the server hung up: anyio's task group inside purerpc's
        # socket can raise the cancellation beside the hang-up's EndOfStream, as one group that
        # `except Exception` does not take. The cancellation alone is what happened: raised alone,
        # it ends at its own cancel scope instead of crashing the caller's nursery.
        cancelled, _ = group.split(trio.Cancelled)
        if cancelled is None:
            raise
        raise cancelled from None


@asynccontextmanager
async def open_stream(
    socket_path: str, method: Method, request: Any, *, timeout: float, metadata: tuple[tuple[str, str], ...] = ()
) -> AsyncIterator[Any]:
    """Start a server-streaming call (ListAndWatch) on a unix socket; yield its responses as they come.

    ``timeout`` bounds connecting only: the stream itself lives until the server ends it, the
    connection breaks, or the caller leaves the ``async with``. Iterating (or leaving) raises
    RPCError when the server ends the stream with an error status or the connection is lost.
    ``metadata``: request headers, (name, value) pairs."""
    try:
        with trio.fail_after(timeout):
            socket_stream = await anyio.connect_unix(socket_path)
    except (OSError, trio.TooSlowError) as error:
        raise RPCError(StatusCode.UNAVAILABLE, f"{method.path} on {socket_path}: {_describe(error)}") from None
    connection = GRPCConnection(_grpc_configuration(client_side=True))
    try:
        with _unwrap_single_errors():
            async with socket_stream, _GRPCSocket(socket_stream, connection) as grpc_socket:
                async with _request(grpc_socket, method, request, metadata) as stream:
                    async with contextlib.aclosing(_responses(stream, f"{method.path} on {socket_path}")) as responses:
                        yield responses
    except _GOODBYE:
        raise RPCError(StatusCode.UNAVAILABLE, f"{method.path} on {socket_path}: connection lost") from None
    except BaseExceptionGroup as group:
        # The server hung up while our writer was sending (a SETTINGS ack, a WINDOW_UPDATE): the
        # writer's goodbye comes with what the caller's side raised meanwhile, the lost stream's
        # RPCError or a cancellation. That is what the caller must get, not the group.
        rest = group.subgroup(lambda error: not isinstance(error, (BaseExceptionGroup, *_GOODBYE)))
        if rest is None:
            raise RPCError(StatusCode.UNAVAILABLE, f"{method.path} on {socket_path}: connection lost") from None
        raise _innermost(rest) from None


async def _responses(stream: GRPCProtoStream, what: str) -> AsyncGenerator[Any, None]:
    while True:
        try:
            message = await stream.receive_message()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            raise RPCError(StatusCode.UNAVAILABLE, f"{what}: connection closed") from None
        if message is None:
            break
        yield message
    status = stream.end_stream_event.status
    if status.status_code != StatusCode.OK:
        raise RPCError(status.status_code, status.status_message)


########################################################################################################
# 6. I/O edges: the config file, inotify, registration, the DevicePlugin service
#
# Rules for this section: each piece waits on the kernel (inotify, sockets); timers only bound
# what another party may take (Register's deadline and backoff, pre_start's timeout, a removed
# resource's goodbye) or space a stream's messages (LIST_PUSH_INTERVAL), never to poll, with one
# exception: while one of the node's inotify limits keeps something from being watched, it is
# rescanned every INOTIFY_RETRY_INTERVAL (DirectoryWatch), and only until it can be watched again.
# Long-running functions take task_status and call started() only once their promise holds.
########################################################################################################
# 6a. The config file, inotify and the devices it watches ----------------------------------------------
#: Register may take a while: the kubelet dials the plugin back inside the call, allowing that 10 s.
#: A little more than that, so that we report the kubelet's own error instead of our timeout.
REGISTER_TIMEOUT = 15.0

# After a failed Register: retry after 10 ms, doubling up to 5 s. The first retries are quick
# because inotify reports kubelet.sock at bind(), a moment before the kubelet listen()s on it.
_REGISTER_BACKOFF = (0.01, 5.0)

#: At most one ListAndWatch message per stream per this many seconds.
LIST_PUSH_INTERVAL = 0.01

#: How long a removed resource's goodbye (the empty list) may take before its server is stopped anyway.
RETIRE_GRACE = 2.0

#: While an inotify limit keeps a directory from being watched, it is rescanned this often (seconds),
#: and its watches are tried again. 5 s is what the most used generic device plugin does all the time
#: (squat/generic-device-plugin, deviceCheckInterval in deviceplugin/generic.go), so the kubelet is
#: told no later than it would be by that one; here only while the limit is reached.
INOTIFY_RETRY_INTERVAL = 5.0

# A directory that appears while its watch is placed is looked for again, this many times at most:
# one that keeps coming and going could otherwise keep us there forever. After that, the watch stays
# on its parent, whose next event about it places the watches again.
_PLACING_TRIES = 8

_DIRECTORY_EVENTS = flags.CREATE | flags.DELETE | flags.MOVED_FROM | flags.MOVED_TO | flags.ATTRIB
_GONE = flags.IGNORED | flags.DELETE_SELF | flags.MOVE_SELF

#: How long one part of a stop (a socket's server, a watch, the API client) may take once told to
#: stop. Each ends in milliseconds: its task is cancelled, its sockets and inotify descriptors are
#: closed, nothing waits for a peer. What can take longer is work no cancellation interrupts: a
#: thread writing the claim checkpoint (its fsync on a slow disk, or its flock while the other pod
#: of a rolling update writes), or the metrics server's thread (up to half a second). A second
#: is several times what those take when they go well, and short beside the kubelet's grace period.
STOP_PART_TIMEOUT = 1.0


async def _stop_part(part: str, stop: Callable[[], Awaitable[Any]], bound: float = STOP_PART_TIMEOUT) -> None:
    """Run ``stop()``, one part of a stop, for at most ``bound`` seconds, between two lines of the
    stop's trace at debug level: "stop: <part>: waiting" and "stop: <part>: done in N ms". A part
    cut off at its bound, or one that overran it where nothing can interrupt it (a thread), gets a
    warning naming it instead: with the trace, one stop on a real node says where its time went.

    Shielded: it runs while whatever is stopping us is cancelled (the command line's SIGTERM)."""
    log.debug("stop: %s: waiting", part)
    began = trio.current_time()
    with trio.CancelScope(shield=True, deadline=began + bound) as scope:
        await stop()
    took = 1000 * (trio.current_time() - began)
    if scope.cancelled_caught:
        log.warning("stop: %s: not done after %g s: stopping the rest without it", part, bound)
    elif took > 1000 * bound:
        log.warning("stop: %s: done in %.0f ms, more than its %g s", part, took, bound)
    else:
        log.debug("stop: %s: done in %.0f ms", part, took)


async def _cancel_and_wait(scope: trio.CancelScope, done: trio.Event) -> None:
    scope.cancel()
    await done.wait()


class _Parts:
    """The long-running tasks of one nursery, stopped one at a time, the last started first.

    trio cancels every task under a cancelled scope at once, and the time each takes to end is lost
    in the others'. So each part here runs shielded once it has started: a cancel from outside does
    not reach it, and stop(), which the nursery's owner calls in a `finally`, cancels each one in
    turn through _stop_part: its own trace, its own bound. A part still running at its bound (a
    thread the kernel holds) is left to end by itself while the next ones stop; the nursery then
    waits for it, and the command line waits no longer than STOP_TIMEOUT. A part that raises once
    started is started again (_supervised); one that raises RestartNeeded, or before its started(),
    cancels the nursery's owner, whose `finally` stops the others.

    Not shielded while it starts: a part that waits for something before started() (a directory
    that is not there yet) is cancelled with its starter."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        self._parts: list[tuple[str, trio.CancelScope, trio.Event, float]] = []

    async def start(
        self,
        part: str,
        function: Callable[..., Awaitable[Any]],
        *args: Any,
        bound: float = STOP_PART_TIMEOUT,
        supervise: bool = True,
    ) -> Any:
        """``await nursery.start(function, *args)``, as the part named ``part``, _supervised unless it
        supervises its own tasks; what it started with."""
        scope, done = trio.CancelScope(), trio.Event()
        run_part = functools.partial(_supervised, part, function) if supervise else function

        async def run(*, task_status: trio.TaskStatus[Any]) -> None:
            try:
                with scope:
                    await run_part(*args, task_status=task_status)
            finally:
                done.set()

        started = await self._nursery.start(run)
        scope.shield = True
        # Parts that ended (a resource a reload stopped) are forgotten: they are not part of a stop.
        self._parts = [entry for entry in self._parts if not entry[2].is_set()]
        self._parts.append((part, scope, done, bound))
        return started

    async def stop(self) -> None:
        """Stop every part still running, the last started first, each within its bound."""
        while self._parts:
            part, scope, done, bound = self._parts.pop()
            if not done.is_set():
                await _stop_part(part, functools.partial(_cancel_and_wait, scope, done), bound)


#: A failed task (_supervised) starts again after SUPERVISE_BACKOFF[0] s, doubled at each failure in a
#: row up to SUPERVISE_BACKOFF[1], jittered: as client-go's reflectors relist after any error (800 ms to
#: 30 s). SUPERVISE_BOUND failures in a row fail /healthz: the kubelet's liveness probe restarts the pod,
#: the process never ends by itself. One that ran SUPERVISE_STEADY s since its restart has recovered.
SUPERVISE_BACKOFF, SUPERVISE_BOUND, SUPERVISE_STEADY = (0.5, 30.0), 5, 60.0


class _Run:
    """One run of a supervised task: its started() passed on, with ``then`` (see _works_later), and when."""

    def __init__(self, status: trio.TaskStatus[Any], then: Callable[[], None] | None = None) -> None:
        self.status, self.then = status, then
        self.at: float | None = None

    def started(self, value: Any = None) -> None:
        self.at = trio.current_time()
        self.status.started(value)
        if self.then is not None:
            self.then()


def _works_later(status: trio.TaskStatus[Any]) -> Callable[[], None] | None:
    """For a task whose started() comes before it works (a registration listens before Register is accepted):
    what it calls once it works, when _supervised says it runs again (None: a first run, nothing to say)."""
    if not isinstance(status, _Run):
        return None
    then, status.then = status.then, None
    return then


async def _supervised(
    part: str,
    function: Callable[..., Awaitable[Any]],
    *args: Any,
    task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED,
) -> None:
    """``await function(*args, task_status=...)`` until it returns, started again (SUPERVISE_BACKOFF)
    whenever it raises once started: from the truth (it rescans, relists, rereads), what it published
    kept meanwhile. One ERROR line when failures begin, one when it runs again, none a retry (nor for
    NotYet: its task says why); gopherplug_task_restarts counts by ``part``. What it raises before its
    first started() (the plugin stops at start with that line), RestartNeeded and cancellation go through."""
    failures, counted, said = 0, 0, False  # counted: the failures /healthz counts (not NotYet's)
    run = _Run(task_status)

    def steady() -> bool:
        return run.at is not None and trio.current_time() - run.at >= SUPERVISE_STEADY

    def problem() -> str:
        return f"failed {failures} times in a row" if counted >= SUPERVISE_BOUND and not steady() else ""

    def recovered() -> None:
        nonlocal said
        if counted and not said:
            log.info("%s runs again, after %s", part, "1 failure" if failures == 1 else f"{failures} failures")
            said = True

    with _health_check(part, problem):
        while True:
            try:
                await function(*args, task_status=run)
                return
            except Exception as error:
                if isinstance(innermost := _innermost(error), RestartNeeded) or (
                    run.at is None and run.status is not trio.TASK_STATUS_IGNORED
                ):
                    raise
                if steady():
                    failures, counted, said = 0, 0, False  # it ran long enough since it came back: a new run
                failures, counted = failures + 1, counted + (not (quiet := isinstance(innermost, NotYet)))
                if counted == 1 and not quiet:
                    what = f"{type(innermost).__name__}: {_describe(error)}"
                    log.error("%s failed: %s; starting it again (the traceback is at log level debug)", part, what)
                log.debug("%s: the failure's traceback:", part, exc_info=True)
                if _metrics is not None:
                    _metrics.restarts.labels(part).inc()
                run = _Run(trio.TASK_STATUS_IGNORED, recovered)
                await trio.sleep(jittered(min(SUPERVISE_BACKOFF[0] * 2 ** min(failures - 1, 32), SUPERVISE_BACKOFF[1])))
            except BaseExceptionGroup as group:
                # A failure that met the task's stop (a reload, SIGTERM) in one of its nurseries: the task ends
                # anyway, and the failure, raised on, would end the plugin. Only the Cancelled go on, for
                # their cancel scope to absorb.
                cancelled, failed = group.split(trio.Cancelled)
                if cancelled is None or not isinstance(failed, Exception):
                    raise
                log.debug("%s failed as it stopped:", part, exc_info=failed)
                raise cancelled from None


def _mode(path: str) -> int | None:
    """What is at ``path`` (its st_mode, following symlinks), None when nothing or it cannot be seen."""
    try:
        return os.stat(path).st_mode
    except (OSError, ValueError):
        return None


def load_config(
    path: str,
    device_plugin_dir: str | None = None,
    device_plugin_dir_from: str = "--device-plugin-dir",
    *,
    objects: bool = False,
) -> Config:
    """Read and validate a configuration file; ``device_plugin_dir``, if given, overrides the file's
    (``device_plugin_dir_from`` names where it was given, for a message about it). With ``objects``
    (check-config), the file may be Kubernetes objects instead: the chart's ConfigMap, or `helm
    template`'s whole output, whose ConfigMap's config.yaml is the configuration (_configmap_config)."""
    try:
        text: str = _within(functools.partial(_file_text, path))
    except OSError as error:
        raise ConfigError(path, "", f"cannot read: {_describe(error)}") from None
    source = path
    if objects:
        text, source = _configmap_config(text, path)
    return _config_from_text(text, source, device_plugin_dir, device_plugin_dir_from)


def _configmap_config(text: str, path: str) -> tuple[str, str]:
    """(configuration text, its source for messages) of a file that may hold Kubernetes objects: the
    config.yaml of its one ConfigMap that has that key (what the chart renders, alone or among the
    DaemonSet and the rest), else the text itself, a configuration file, for parse_config."""
    if "kind" not in text:  # a configuration file has no kind: no second parse of it
        return text, path
    try:
        documents = [doc for doc in yaml.safe_load_all(text) if isinstance(doc, dict)]
    except yaml.YAMLError:
        return text, path  # parse_config says where
    if not any("apiVersion" in doc and "kind" in doc for doc in documents):
        return text, path
    found = [
        doc
        for doc in documents
        if doc.get("kind") == "ConfigMap"
        and isinstance(doc.get("data"), dict)
        and isinstance(doc["data"].get("config.yaml"), str)
    ]
    metadata = [doc.get("metadata") or {} for doc in found]
    names = [f"{each.get('namespace', '')}/{each.get('name', '')}" for each in metadata]
    if len(found) != 1:
        kinds = ", ".join(dict.fromkeys(str(doc.get("kind")) for doc in documents))
        what = (
            f"{len(found)} ConfigMaps with a config.yaml key ({', '.join(names)})"
            if found
            else f"{kinds}, and no ConfigMap with a config.yaml key"
        )
        problem = f"holds Kubernetes objects, {what}: give the chart's ConfigMap, helm template's output, "
        problem += "or the configuration file"
        raise ConfigError(path, "", problem)
    return found[0]["data"]["config.yaml"], f"{path} (ConfigMap {names[0].lstrip('/')}, config.yaml)"


def _config_from_text(
    text: str, path: str, device_plugin_dir: str | None, device_plugin_dir_from: str = "--device-plugin-dir"
) -> Config:
    # The pod's UID comes with the pod, not the file: every reading of the file gets it, so that a
    # reload compares the same driver.
    config = with_pod_uid(parse_config(text, path), os.environ.get(POD_UID_ENV, ""))
    if device_plugin_dir is not None:
        if not os.path.isabs(device_plugin_dir):
            raise ConfigError(device_plugin_dir_from, "", f"{device_plugin_dir!r} must be an absolute path")
        if (problem := device_plugin_dir_problem(os.path.normpath(device_plugin_dir))) is not None:
            raise ConfigError(device_plugin_dir_from, "", problem)
        config = dataclasses.replace(config, device_plugin_dir=os.path.normpath(device_plugin_dir))
    return config


def _inotify_limit(error: OSError, creating: bool) -> str | None:
    """Which limit a failed inotify_init1() (``creating``) or inotify_add_watch() ran into, as the
    log says it; None when the error is about the path instead (missing, not a directory, not
    readable), which keeps its meaning: nothing there to watch yet."""
    if creating and error.errno == errno.EMFILE:
        try:  # EMFILE also means this process has no file descriptor left: has it one?
            os.close(os.open("/", os.O_RDONLY | os.O_CLOEXEC))
        except OSError:
            return "this process's limit of open files is reached (raise its RLIMIT_NOFILE)"
        return "the node's limit of inotify instances is reached (raise the sysctl fs.inotify.max_user_instances)"
    if creating and error.errno == errno.ENFILE:
        return "the node's limit of open files is reached (raise the sysctl fs.file-max)"
    if not creating and error.errno == errno.ENOSPC:
        return "the node's limit of inotify watches is reached (raise the sysctl fs.inotify.max_user_watches)"
    return "the kernel has no memory left for inotify" if error.errno == errno.ENOMEM else None


# What serve says, and check-config before it (missing_extras), when an extra is not installed.
_METRICS_EXTRA = (
    "metrics_address needs prometheus_client ({error}): install gopherplug with its metrics extra, "
    "pip install '.[metrics]' in a checkout"
)
_DRA_EXTRA = (
    "DRA needs the Kubernetes client lightkube ({error}): install gopherplug with its dra extra, "
    "pip install '.[dra]' in a checkout"
)


def missing_extras(config: Config) -> list[str]:
    """For check-config: a line for each extra the configuration needs that cannot be imported
    (serve would stop at start with that line): prometheus_client for ``metrics_address``, lightkube
    and httpx2 for ``dra``. Imported as serve imports them, so a broken install is found too."""
    problems = []
    if config.metrics_address is not None:
        try:
            import prometheus_client  # noqa: F401
        except ImportError as error:
            problems.append(_METRICS_EXTRA.format(error=error))
    if config.dra is not None:
        try:
            _import_api_client()
        except ImportError as error:
            problems.append(_DRA_EXTRA.format(error=error))
    return problems


class DirectoryWatch:
    """inotify on a directory that may not exist yet, may be deleted, and may come back.

    Besides the directory itself, the nearest existing ancestor is watched, so that the directory
    (or a missing parent) appearing, vanishing or being replaced is seen too; watches are then
    re-armed, because a deleted directory's watch is gone for good (IN_DELETE_SELF, IN_IGNORED).
    ``follow(paths)`` adds paths elsewhere whose appearing, vanishing or changing attributes count
    as a change too (a device's symlink targets); ``watch_also(directories)`` adds directories
    whose every entry does. Use as a context manager; iterate ``batches()``.

    inotify has limits per user, shared by all of that user's processes on the node (root's:
    the container runtime's, the kubelet's, every other plugin's): fs.inotify.max_user_instances
    for INotify(), fs.inotify.max_user_watches for add_watch(). What one of them keeps from being
    watched is not missing, and must not be mistaken for it: the watch is then *degraded*
    (``limit`` says why), which ``logger`` hears once, and batches() also wakes every
    INOTIFY_RETRY_INTERVAL seconds to try the watches again and call for a rescan, until they all
    hold again (``logger`` hears that too). Only then, and before any unmount, does no timer run.

    add_watch() looks its path up, which under a dead NFS or hung FUSE mount never returns: with ``off_loop``
    (a resource's directories) the owner places them in its worker thread (placed()); the kubelet's and the
    configuration's directories are the node's own, watched on the loop."""

    def __init__(
        self,
        path: str,
        mask: int,
        follow_mask: int = 0,
        logger: logging.Logger | logging.LoggerAdapter[logging.Logger] = log,
        off_loop: bool = False,
    ) -> None:
        self.path, self._mask, self._log = path, mask, logger
        self._follow_mask = _LEADING_EVENTS | follow_mask
        self._inotify: INotify | None = None  # None: not even an instance could be had
        # wd -> how many reasons we have to care about each name in that directory; _DIR: the
        # watched directory itself, every event reported
        self._watches: dict[int, collections.Counter[str]] = {}
        self._dirs: dict[int, str] = {}  # wd -> the directory it watches
        self._followed: dict[str, tuple[int, str]] = {}  # followed path -> (wd, name) leading to it
        self._leading = (-1, "")  # (wd, name) leading to the directory itself
        self._also: dict[str, int] = {}  # a directory watched whole -> its wd (-1: not watched, e.g. missing)
        self.exists = False  #: whether the directory itself exists, as the last arm() found
        self.limit: str | None = None  #: the inotify limit that keeps something from being watched
        self._said: str | None = None  # the limit the log last heard of
        self._poke_pending = False  # poke() was called and batches() has not answered it yet
        self._waiting: trio.CancelScope | None = None  # batches() waiting for the kernel
        self.poked = False  #: whether the last batch was the answer to poke(), not the kernel's
        self._again_at = math.inf  # when batches() calls for a rescan by itself (again())
        self._covered: tuple[int, ...] = (-1, -1)  # the device and inode at the path at the last look (none: a mount)
        self._look_at = math.inf  # after an unmount: when batches() next looks at what is at the path
        self._off_loop, self._stale = off_loop, True  # _stale: every watch is to be placed (_place)
        self._moved: set[tuple[int, str]] = set()  # (wd, name)s leading to followed paths, since changed
        self._placing, self._stopped, self._closing = False, False, threading.Lock()  # who closes it: placed()
        self.arm()

    def __enter__(self) -> DirectoryWatch:
        return self

    def poke(self) -> None:
        """Have batches() yield a rescan now, as if the kernel had said something changed: for a
        change inotify cannot see, on request (SIGHUP). Called from a task of the same trio run."""
        self._poke_pending = True
        if self._waiting is not None:
            self._waiting.cancel()

    def again(self, delay: float) -> None:
        """Have batches() call for a rescan within ``delay`` seconds: what failed for want of a
        resource (a scan or a read out of descriptors) is tried again, with no event to wait for."""
        self._again_at = min(self._again_at, trio.current_time() + delay)
        if self._waiting is not None:
            self._waiting.deadline = min(self._waiting.deadline, self._again_at)

    def __exit__(self, *exc_info: object) -> None:
        with self._closing:
            self._stopped = True
            if self._inotify is not None:
                # trio must forget the fd before it is closed, or a task waiting on it would never wake.
                trio.lowlevel.notify_closing(self._inotify.fileno())
                if not self._placing:  # (else placed()'s thread closes it as it returns)
                    self._inotify.close()

    def follow(self, paths: Iterable[str]) -> set[str]:
        """Watch exactly these paths besides the directory (their nearest existing ancestor when
        missing), from now on. Returns the paths newly watched: what happened to them before now
        was not seen, so the caller must look at them again. One an inotify limit keeps from being
        watched is followed all the same (rescans stand in for its events): new once, not each call."""
        paths = set(paths)
        for path in set(self._followed) - paths:
            self._unwatch(*self._followed.pop(path))
        new = paths - set(self._followed)
        for path in new:
            self._followed[path] = self._watch_leading_to(path)
        self._say()
        return new

    def watch_also(self, directories: Iterable[str]) -> set[str]:
        """Watch exactly these directories whole besides, from now on: an event about any entry
        in them is reported as that entry's path touched. A missing one is not watched (watch its
        parent too, to see it come). Returns the directories newly watched, as follow() does."""
        directories = set(directories)
        for path in set(self._also) - directories:
            self._unwatch(self._also.pop(path), _ALL)
        new = set()
        for path in directories:
            if self._also.get(path, -1) == -1:
                self._also[path] = self._watch_whole(path)
                if self._also[path] != -1:
                    new.add(path)
        self._say()
        return new

    def _watch_whole(self, path: str) -> int:
        if self._inotify is None:
            return -1
        try:
            wd: int = self._inotify.add_watch(path, _DIRECTORY_EVENTS | flags.ONLYDIR | flags.MASK_ADD)
        except OSError as error:
            self._limited(error)
            return -1
        self._watches.setdefault(wd, collections.Counter())[_ALL] += 1
        self._dirs[wd] = path
        return wd

    def arm(self) -> None:
        """(Re)place every watch: the directory if it exists, and for it and every followed path, the nearest
        existing ancestor, interested in the name that leads there; an inotify limit met sets ``limit``, none
        clears it. With ``off_loop``, only removes them: placed() places them, in the owner's worker thread."""
        self.limit, self._stale = None, True
        if self._inotify is None:
            try:
                self._inotify = INotify(nonblocking=True)
            except OSError as error:
                self.limit = _inotify_limit(error, creating=True)
                if self.limit is None:
                    raise
        else:  # (a new instance has no watches yet)
            for wd in self._watches:
                with contextlib.suppress(OSError):  # already removed by the kernel with its directory
                    self._inotify.rm_watch(wd)
        self._watches.clear()
        self._dirs.clear()
        if not self._off_loop:
            self._place()

    def _place(self) -> None:
        """Place every watch after arm(); else place anew, from its nearest existing ancestor (which
        may now lie deeper, or higher), each followed path on whose way something came or went (_moved)."""
        if self._stale:
            for tries in range(1, _PLACING_TRIES + 1):
                why_not = self._watch_directory()
                self.exists = not why_not
                self._leading = self._watch_leading_to(self.path)
                if why_not not in _NOT_THERE or tries == _PLACING_TRIES or not os.path.isdir(self.path):
                    break
                # It appeared after its own add_watch failed and before its parent's watch was placed:
                # that watch never saw it come. Watch it again.
                self._unwatch(*self._leading)
            for path in self._followed:
                self._followed[path] = self._watch_leading_to(path)
            for path in self._also:
                self._also[path] = self._watch_whole(path)
        elif self._moved:
            for path, leading in self._followed.items():
                if leading in self._moved:
                    self._unwatch(*leading)
                    self._followed[path] = self._watch_leading_to(path)
        self._stale, self._moved = False, set()
        self._say()

    def placed(self, look: Callable[[], Any]) -> Any:
        """In the owner's worker thread (_looked, with ``off_loop``): what is to be placed (_place), then ``look()``,
        which may place more (follow, watch_also); the loop, its owner awaiting this, leaves the watch alone. A stop
        abandons the thread, which may return much later: __exit__ leaves it the descriptor's close, or its watches
        would go to whatever file has the number by then (a duplicate would take one: out of them, rescans go on)."""
        with self._closing:
            if self._stopped:
                return None  # stopped before this thread began: no one waits for it
            self._placing = True
        try:
            self._place()
            return look()
        finally:
            with self._closing:
                self._placing = False
                if self._stopped and self._inotify is not None:
                    self._inotify.close()  # left to this thread by __exit__

    def _watch_directory(self) -> int:
        """Watch the directory itself. Returns 0 if it exists, else why not (an errno)."""
        if self._inotify is None:
            return 0 if os.path.isdir(self.path) else errno.ENOENT
        try:
            wd = self._inotify.add_watch(self.path, self._mask | flags.ONLYDIR)
        except OSError as error:
            # The kernel looks the path up before it counts the watch against a limit: a limit
            # met means the directory is there. Any other error: missing, not a directory, or not
            # readable; no devices until that changes.
            return 0 if self._limited(error) else error.errno or errno.EIO
        self._watches[wd] = collections.Counter({_DIR: 1})
        self._dirs[wd] = self.path
        return 0

    def _watch_leading_to(self, path: str) -> tuple[int, str]:
        if self._inotify is None:
            return -1, os.path.basename(path)
        child, ancestor = os.path.basename(path), os.path.dirname(path)
        # child_was_there is False when add_watch() found no directory at ancestor/child: if there
        # is one once ancestor is watched, it appeared in between. (path itself is not tried here.)
        tries, child_was_there = 0, True
        while True:
            try:
                # MASK_ADD: a directory watched for several reasons keeps every event it was asked for.
                wd = self._inotify.add_watch(ancestor, self._follow_mask | flags.MASK_ADD)
            except OSError as error:
                if self._limited(error) or ancestor == os.path.dirname(ancestor):
                    return -1, child  # a limit (higher up would meet it too), or not even "/" can be watched
                child, ancestor = os.path.basename(ancestor), os.path.dirname(ancestor)
                child_was_there = error.errno not in _NOT_THERE
                continue
            self._watches.setdefault(wd, collections.Counter())[child] += 1
            self._dirs[wd] = ancestor
            tries += 1
            if child_was_there or tries == _PLACING_TRIES or not os.path.isdir(os.path.join(ancestor, child)):
                return wd, child
            # ancestor/child appeared after its own add_watch failed and before this one was placed:
            # this watch never saw it come. Start again from the bottom, which may now lie deeper.
            self._unwatch(wd, child)
            child, ancestor, child_was_there = os.path.basename(path), os.path.dirname(path), True

    def _limited(self, error: OSError) -> bool:
        """Whether a failed add_watch() met an inotify limit; if so, the watch is degraded."""
        limit = _inotify_limit(error, creating=False)
        if limit is not None:
            self.limit = limit
        return limit is not None

    def _say(self) -> None:
        """Tell the log when the watch is degraded (or by another limit), and when it is whole again."""
        if self.limit == self._said or self._placing:
            return  # once, not at every retry; and on the loop, not in placed()'s thread (batches() says it)
        if self.limit is not None:
            again = f"rescanning it every {INOTIFY_RETRY_INTERVAL:g} s until it can be watched"
            self._log.warning("cannot watch %s with inotify: %s; %s", self.path, self.limit, again)
        else:
            self._log.info("watching %s with inotify again", self.path)
        self._said = self.limit

    def _unwatch(self, wd: int, name: str) -> None:
        names = self._watches.get(wd)
        if names is None:
            return  # gone with an arm()
        names[name] -= 1
        if names[name] <= 0:
            del names[name]
        if not names:
            del self._watches[wd]
            del self._dirs[wd]
            with contextlib.suppress(OSError):
                if self._inotify is not None:  # (it is: there are no watches without one)
                    self._inotify.rm_watch(wd)

    async def batches(self) -> AsyncGenerator[tuple[list[tuple[str, int]], set[str], bool], None]:
        """Yield, for each batch the kernel delivers: the directory's events as (name, mask); the
        followed paths (or their missing ancestors) that changed; and whether everything must be
        rescanned (the directory came or went, a watched directory vanished, the queue overflowed).

        While degraded, also every INOTIFY_RETRY_INTERVAL seconds, and when again() asked: the
        watches are placed again, and a rescan is called for (what was not seen may have changed)."""
        while True:
            self._say()
            if self.limit is not None:
                self.again(INOTIFY_RETRY_INTERVAL)  # (the earliest stands): no timer while every watch holds
            if not self._poke_pending:
                with trio.move_on_at(min(self._again_at, self._look_at)) as self._waiting:
                    if self._inotify is None:
                        await trio.sleep_forever()  # no instance to wait on: only the timer
                    await trio.lowlevel.wait_readable(self._inotify.fileno())
                self._waiting = None
            self.poked, self._poke_pending = self._poke_pending, False
            if self.poked:
                yield [], set(), True
                continue
            if trio.current_time() >= self._look_at:  # unmounted once: what is at the path now? (no event says)
                # For as long as the watch lives (a stat): a look may fall between an umount and the next
                # mount (or before the umount's event), and watches on a bare mount point hear of no mount.
                self._look_at = trio.current_time() + INOTIFY_RETRY_INTERVAL
                try:  # a stat on a dead NFS or FUSE mount never returns: off the loop, given up (looked again)
                    now, parent = await trio.to_thread.run_sync(_within, self._look, abandon_on_cancel=True)
                except TimeoutError:
                    continue
                if now != self._covered:  # (not the change time)
                    if now[:1] not in ((), parent):
                        self._log.info("%s: a file system is mounted there again: watching it", self.path)
                    elif self._covered[:1] not in ((), parent):
                        self._log.warning("%s: its file system was unmounted: looking for a new mount there", self.path)
                    self._covered = now
                    self.again(0)
            if trio.current_time() >= self._again_at:
                self._again_at = math.inf
                self.arm()  # (what could not be watched, or was unmounted, may be watched now)
                yield [], set(), True
                continue
            batch = self.pending()
            if batch is not None:
                yield batch

    def _look(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The device and inode at the path, and its parent's device (a mount point's differs)."""
        return (_identity(self.path) or ())[:2], (_identity(os.path.dirname(self.path)) or (-2,))[:1]

    def pending(self) -> tuple[list[tuple[str, int]], set[str], bool] | None:
        """What the kernel has queued and batches() has not yielded yet, read now without waiting,
        as batches() would yield it; None if nothing. For a reader that must be up to date before
        it acts (KubeletWatch.current): batches() then goes on with what comes after."""
        inotify = self._inotify
        if inotify is None:
            return None
        events: list[tuple[str, int]] = []
        touched: set[str] = set()
        rescan = False
        for event in inotify.read(timeout=0):
            names = self._watches.get(event.wd, collections.Counter())
            if event.mask & flags.UNMOUNT:
                # The kernel drops the watches of a file system unmounted; one mounted there later
                # sends no event at all: batches() looks at what is at the path, now and from then on.
                self._look_at = min(self._look_at, trio.current_time())
            if event.mask & flags.Q_OVERFLOW or (names and event.mask & _GONE):
                if event.mask & flags.Q_OVERFLOW and _metrics is not None:
                    _metrics.overflows.inc()
                rescan = True  # events were lost, or a watch is gone for good: start afresh
            elif _DIR in names and event.name:
                events.append((event.name, event.mask))
            elif _DIR in names:
                rescan = True  # about the directory itself (its mode changed, say): look at all
            if (event.wd, event.name) == self._leading:
                rescan = True  # the directory (or a missing parent) came, went or was replaced
            elif event.name in names and not rescan:
                touched.add(os.path.join(self._dirs[event.wd], event.name))
                self._moved.add((event.wd, event.name))  # followed paths may lead through it: placed anew
            if _ALL in names and event.name and not rescan:
                touched.add(os.path.join(self._dirs[event.wd], event.name))
        if rescan:
            if _metrics is not None:
                _metrics.rescans.inc()
            self.arm()
        elif not self._off_loop:
            self._place()  # (else the owner places them, then looks: placed())
        return (events, touched, rescan) if events or touched or rescan else None


_DIR = ""  # in DirectoryWatch._watches: the watched directory itself, every event reported
_ALL = "/"  # in DirectoryWatch._watches: a directory watched whole (watch_also); no entry's name has a "/"
_NOT_THERE = (errno.ENOENT, errno.ENOTDIR)  # add_watch() found no directory there (yet)
_LEADING_EVENTS = flags.CREATE | flags.DELETE | flags.MOVED_FROM | flags.MOVED_TO | flags.ATTRIB | _GONE | flags.ONLYDIR


class FileLock:
    """An flock on a file, held while this process does what only one process may do.

    The kernel drops an flock when its process dies, SIGKILL and the OOM killer included, so a lock
    is never stale, unlike a pid file. The file says who holds it, for the message a second
    process gets; it is removed by its holder on the way out."""

    def __init__(self, path: str, taken: str, fix: str) -> None:
        self.path = path
        self._taken, self._fix = taken, fix  # for the message: "<taken> by another gopherplug (...): <fix>"
        self._fd = -1

    def held(self) -> bool:
        """Whether we hold the lock on the file that is at its path now (it may have been deleted)."""
        return self._fd >= 0 and _inode(self.path) == os.fstat(self._fd).st_ino

    def acquire(self) -> None:
        """Take the lock and write who holds it; raise GopherplugError naming the holder when another
        live process has it."""
        self.release()
        try:
            while self._fd < 0:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    holder = _lock_holder(os.read(fd, 256).decode(errors="replace").strip())
                    os.close(fd)
                    raise GopherplugError(
                        f"{self._taken} by another gopherplug ({holder}, lock file {self.path}): {self._fix}"
                    ) from None
                if os.fstat(fd).st_ino == _inode(self.path):  # else its last holder removed it meanwhile: again
                    os.ftruncate(fd, 0)
                    holder = f"pid {os.getpid()} on host {os.uname().nodename}, pid namespace {_pid_namespace()}"
                    os.write(fd, f"{holder}\n".encode())
                    self._fd = fd
                else:
                    os.close(fd)
        except PermissionError:
            # Where the DaemonSet drops every capability, root may write only where the owner's bits
            # allow: say what to do, not just errno 13.
            directory = os.path.dirname(self.path)
            raise GopherplugError(
                f"cannot take the lock {self.path}: permission denied: run gopherplug as root, "
                f"and {directory} must belong to root"
            ) from None
        except OSError as error:
            raise GopherplugError(f"cannot take the lock {self.path}: {_describe(error)}") from None

    def release(self) -> None:
        """Give the lock up, removing its file (while still holding it, so no one takes a removed file)."""
        if self._fd >= 0:
            if self.held():
                with contextlib.suppress(OSError):
                    os.unlink(self.path)
            os.close(self._fd)
            self._fd = -1


#: The host's PID namespace: its inode number is fixed (PROC_PID_INIT_INO in the kernel's proc_ns.h).
_HOST_PID_NAMESPACE = str(0xEFFFFFFC)


def _pid_namespace() -> str:
    """This process's PID namespace, as the number /proc shows for it ("" if /proc cannot say)."""
    try:
        return os.readlink("/proc/self/ns/pid").removeprefix("pid:[").removesuffix("]")
    except OSError:
        return ""


def _lock_holder(text: str) -> str:
    """Who holds a lock, from the line its holder wrote, in words that let an operator find it.

    A pid means something only in its own PID namespace, and in a container gopherplug is pid 1,
    so "pid 1" alone sends nobody anywhere: a holder in another namespace is named by its
    hostname (a pod's is its name), and by its pid here when this /proc shows it (a host's does)."""
    found = re.fullmatch(r"pid ([0-9]+) on host (\S+), pid namespace ([0-9]+)", text)
    if found is None:
        return text or "a process"  # an older gopherplug's line, or none
    pid, host, namespace = found.groups()
    ours = _pid_namespace()
    if not ours or namespace == ours:
        return f"pid {pid} on host {host}"
    if namespace == _HOST_PID_NAMESPACE:
        return f"pid {pid} in the host's PID namespace, hostname {host}"
    here = _pid_seen_here(pid, namespace)
    seen = f"; pid {here} in this one" if here else ""
    return f"pid {pid} in another PID namespace (a container{seen}), hostname {host}"


def _pid_seen_here(pid: str, namespace: str) -> str:
    """The pid that process ``pid`` of PID namespace ``namespace`` has in this /proc, or "" if it
    is not in it. The last of the NSpid numbers in /proc/<pid>/status is its pid in its own namespace."""
    with contextlib.suppress(OSError), os.scandir("/proc") as entries:
        for entry in entries:
            with contextlib.suppress(OSError):
                if entry.name.isdigit() and os.readlink(f"/proc/{entry.name}/ns/pid") == f"pid:[{namespace}]":
                    with open(f"/proc/{entry.name}/status", encoding="ascii", errors="replace") as status:
                        for line in status:
                            if line.startswith("NSpid:") and line.split()[-1] == pid:
                                return entry.name
    return ""


class ResourceLock(FileLock):
    """One gopherplug per resource and node: a FileLock on ``<device-plugin dir>/.<socket stem>.lock``.

    Two plugins serving one resource would take turns registering over each other, and a starting
    one could not tell a live instance's sockets from a dead one's. Holding this lock means every
    other socket of the resource in the directory was left by a process that is gone: acquire()
    removes them.

    Today's kubelets delete only the sockets of the directory when they start; older ones deleted
    every file but their checkpoint (ManagerImpl.CleanupPluginDirectory in
    kubernetes/kubernetes pkg/kubelet/cm/devicemanager/manager.go), this one too. So the lock is
    checked, and taken again if need be, before every registration."""

    def __init__(self, resource_name: str, device_plugin_dir: str) -> None:
        self.directory = device_plugin_dir
        self.resource_name = resource_name
        self.stem = socket_stem(resource_name, device_plugin_dir)
        taken = f"{resource_name} is already served on this node"
        fix = "stop that one, or remove the resource from one configuration"
        super().__init__(os.path.join(device_plugin_dir, f".{self.stem}.lock"), taken, fix)

    def acquire(self) -> None:
        """Take the lock, then remove the sockets that dead holders left behind."""
        super().acquire()
        try:
            entries = list(os.scandir(self.directory))
        except FileNotFoundError:
            return  # removed meanwhile, our lock file with it: held() says so, and the caller waits
        for entry in entries:
            parsed = parse_socket_name(entry.name)
            with contextlib.suppress(OSError):
                if (
                    parsed is not None
                    and parsed[0] == self.stem
                    and stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode)
                ):
                    os.unlink(entry.path)
                    # Under the resource's name, as every other line about it (the stem is a file name).
                    _ResourceLog(self.resource_name).info(
                        "removed %s, left by a gopherplug that did not exit cleanly", entry.name
                    )


async def watch_devices(
    resource: ResourceConfig,
    devices: Watched,
    sysfs_root: str = "/sys",
    dev_root: str = "/dev",
    turn: CDISpecTurn | None = None,
    *,
    described: dict[str, ReadValues] | None = None,
    written: dict[str, Any] | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Keep ``devices`` (a dict of id -> DeviceEntry) equal to what the resource's directories and
    USB devices make, until cancelled.

    Each directory has its own inotify watch. A batch of events naming entries re-examines those
    entries only: one change in a directory of 50,000 costs a few system calls, not 50,000. A
    batch that calls for a rescan (the directory came or went, a followed symlink target changed,
    the kernel's queue overflowed) rescans that directory, and so does each of DirectoryWatch's
    retries while an inotify limit keeps it or a followed path from being watched. USB devices
    are read from sysfs again whenever a node comes or goes in /dev (``dev_root``: _UsbTracker).
    Either way a burst becomes one new device set: ListAndWatch streams send the latest set,
    never a backlog.

    With ``cdi``, the CDI spec is rewritten before the kubelet hears of a new device (a container
    may be created with it at once). It stays when this returns: the kubelet keeps the CDI names
    of its allocations and gives them to the runtime again whenever a container restarts, plugin
    running or not (an update rolling through the DaemonSet, an OOM kill). A device leaves the
    spec only when it leaves the directory. With ``turn`` (a DRA driver's pod), the spec is written
    in this pod's turn only (CDISpecTurn), and again whenever the turn changes.

    A device that comes or changes has its ``attributes`` and ``capacity`` files read
    (read_declared_values); the resource's ``describe`` runs in a task of its own whenever the
    devices' IDs change (_describe_devices), starting from ``described`` (what it said before a
    reload), never on a kubelet's call. ``written`` (spec file -> the spec last written there)
    outlives the watch as ``described`` does: a watch started again does not write an unchanged spec."""
    device_set = _DeviceSet(resource, devices, turn, described, written)
    mountinfo = _read_text("/proc/self/mountinfo") or ""
    watching = functools.partial(DirectoryWatch, mask=_DIRECTORY_EVENTS, logger=_log(resource), off_loop=True)
    with contextlib.ExitStack() as stack:
        trackers: list[_SourceTracker | _UsbTracker] = []
        for number, source in enumerate(resource.sources):
            if problem := container_only_problem(source.directory, mountinfo):
                _log(resource).warning("%s", problem)
            watch = stack.enter_context(watching(source.directory))
            trackers.append(_SourceTracker(resource, number, source, watch, sysfs_root, dev_root))
        if resource.usb:
            if problem := container_only_problem(dev_root, mountinfo):
                _log(resource).warning("%s", problem)
            trackers.append(_UsbTracker(resource, stack.enter_context(watching(dev_root)), sysfs_root, dev_root))
        device_set.watches = [tracker.watch for tracker in trackers]
        # A scan that has not returned in FILE_READ_TIMEOUT (_looked) does not hold up the start: the
        # resource is served with its devices as known (none at the process's start), and the
        # resources after it start (each waits for the one before it to start).
        waiting = trio.CancelScope(deadline=trio.current_time() + FILE_READ_TIMEOUT)
        published = trio.Event()

        async def first_scan() -> None:
            # Every source first, then one device set: the CDI spec and the kubelet's first list
            # describe them all.
            changes = {key: entry for tracker in trackers for key, entry in (await tracker.rescan()).items()}
            waiting.deadline = math.inf  # scanned: a value file's read has its own deadline
            await device_set.update(changes)
            published.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(first_scan)
            with waiting:
                await published.wait()
            task_status.started()
            # Only then each source's batches, and the other tasks: what fails in them from here on is
            # the supervisor's to start again, and not a failure at start (which stops the plugin).
            await published.wait()
            for tracker in trackers:
                nursery.start_soon(_follow_source, tracker, device_set)
            if turn is not None:
                nursery.start_soon(_follow_turn, turn, device_set)
            if resource.describe:
                nursery.start_soon(_describe_devices, device_set)
            if any(declared.file for declared in (*resource.attributes, *resource.capacity)):
                nursery.start_soon(_read_values_again, device_set)


#: How much of a program's stderr is kept, at its beginning and at its end: the last line says why
#: it failed (the kubelet shows a pre_start command's in the pod's events), and sometimes only the
#: first does (a script saved with CRLF endings: `'python3\r': No such file or directory`, then a
#: line that does not say why). Whatever the program prints, this is all it costs us.
STDERR_KEPT = 4096
#: Once a program has exited, how long what it printed may take to be read: the pipes hold it
#: already, unless a child it left running holds them too, and writes (it is killed meanwhile).
PROGRAM_EXIT_GRACE = 1.0
#: The programs run_program runs now (_reap_orphans leaves them to trio).
_RUNNING: set[int] = set()


def _kill_process_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def _kill_marked(mark: str) -> None:
    """Kill a daemon a program started (fork, setsid, fork: out of its group) by the mark it inherited, in a
    worker thread within FILE_READ_TIMEOUT (run_program): a busy host has thousands of processes, and the
    environ of one in uninterruptible sleep may never be read. Late or not, a kill follows its own read
    of the mark, random for each run: a pid reused since has no such environ."""
    marked = f"\0GOPHERPLUG_PROGRAM={mark}\0".encode()
    for name in os.listdir("/proc"):
        with contextlib.suppress(OSError, ValueError), open(f"/proc/{name}/environ", "rb") as environ:
            if marked in b"\0" + environ.read():  # gone, not a process or not ours to read: passed over
                os.kill(int(name), signal.SIGKILL)


def _reap_orphans() -> None:
    """As PID 1 of its container, reap the orphans that ended: the kernel makes PID 1 the parent of
    every process whose parent is gone (a child a describe left, killed with its group), a zombie
    until PID 1 waits for it. At each SIGCHLD (serve_until_signalled) and each program's end; the
    ended are peeked at (WNOWAIT) first, and one of run_program's own is left to trio's wait."""
    with contextlib.suppress(ChildProcessError):
        while os.getpid() == 1 and (ended := os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)):
            if ended.si_pid in _RUNNING:
                return  # looked at again as that program ends
            os.waitpid(ended.si_pid, 0)


@dataclass(frozen=True)
class Ran:
    """What run_program saw of a program: its exit status (None: killed at its timeout), its stdout
    (None: not kept, or more than asked for) and the beginning and end of its stderr."""

    returncode: int | None
    stdout: bytes | None
    stderr: bytes

    def said(self) -> str:
        """ ": <its stderr's last line> (first: <its first>)", or " (nothing on stderr)"."""
        lines = [line.strip() for line in self.stderr.decode(errors="replace").splitlines() if line.strip()]
        first = next((line for line in lines if line != "Traceback (most recent call last):"), "")
        first = f" (first: {first[:120]})" if first and first != lines[-1] else ""
        return f": {lines[-1]}{first}" if lines else " (nothing on stderr)"

    def how(self) -> str:
        """How it ended, when not as it should: "exited with 2", "killed by signal 9"."""
        assert self.returncode is not None
        return f"exited with {self.returncode}" if self.returncode > 0 else f"killed by signal {-self.returncode}"


async def run_program(
    argv: Iterable[str], env: Mapping[str, str], *, limit: int = 0, timeout: float = math.inf, fds: tuple[int, ...] = ()
) -> Ran:
    """Run ``argv`` until it exits: the one runner of describe, pre_start and exec credential plugins.
    No shell, stdin /dev/null, ``fds`` passed on; stdout kept up to ``limit`` bytes (0: /dev/null;
    past it the program is killed, and Ran.stdout is None), both pipes read as it writes. Raises OSError if it
    cannot be started.

    Resource handling: the program runs in its own process group, killed whole once the program exits,
    at ``timeout`` and when cancelled, with what left the group (_kill_marked): nothing it started
    outlives it. Its answer is taken when it exits, not at end of file, which a child it left running
    (`sleep &`) would hold off; the pipes are read for PROGRAM_EXIT_GRACE more. The group is killed as
    soon as the program is reaped, before any other task runs: its ID cannot have gone to another of ours."""
    stdout, stderr = bytearray(), bytearray()
    too_much = timed_out = False
    mark = os.urandom(8).hex()
    process = await trio.lowlevel.open_process(
        list(argv),
        env={**env, "GOPHERPLUG_PROGRAM": mark},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE if limit else subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
        pass_fds=fds,
    )
    _RUNNING.add(process.pid)

    async def read(stream: trio.abc.ReceiveStream, into: bytearray) -> None:
        nonlocal too_much
        async with stream:
            async for chunk in stream:
                into += chunk
                if into is stderr and len(into) > 2 * STDERR_KEPT:
                    del into[STDERR_KEPT:-STDERR_KEPT]
                elif into is stdout and len(into) > limit:
                    too_much = True
                    return _kill_process_group(process.pid)  # nothing it prints now is read

    try:
        async with trio.open_nursery() as nursery:
            for stream, into in ((process.stdout, stdout), (process.stderr, stderr)):
                if stream is not None:
                    nursery.start_soon(read, stream, into)
            with trio.move_on_after(timeout) as deadline:
                await process.wait()
            timed_out = deadline.cancelled_caught
            _kill_process_group(process.pid)
            with trio.CancelScope(shield=True):  # at its timeout: killed just now, it ends at once
                await process.wait()
            nursery.cancel_scope.deadline = trio.current_time() + PROGRAM_EXIT_GRACE
    finally:
        if process.returncode is None:  # cancelled: killed with what it started
            _kill_process_group(process.pid)
            with trio.CancelScope(shield=True):
                await process.wait()
        with trio.CancelScope(shield=True), contextlib.suppress(TimeoutError):  # a hung thread is left to itself
            await trio.to_thread.run_sync(_within, functools.partial(_kill_marked, mark))
        _RUNNING.discard(process.pid)
        _reap_orphans()
    kept = None if too_much or not limit else bytes(stdout)
    return Ran(None if timed_out else process.returncode, kept, bytes(stderr))


#: How long a resource's ``describe`` may run before it is killed (with what it started)
DESCRIBE_TIMEOUT = 10.0
#: The most a ``describe`` may print: more is not a description of a node's devices
DESCRIBE_MAX_OUTPUT = 1024 * 1024
#: A failed ``describe`` is run again after the first of these, doubled at each failure up to the
#: second (seconds, jittered): what it needs may come later (a driver loading), and its values then
DESCRIBE_RETRY = (5.0, 300.0)


#: GOPHERPLUG_DEVICES holds the IDs up to this many bytes, empty past it (the kernel starts no program
#: with a variable over 128 KiB, MAX_ARG_STRLEN: ~14,500 IDs); GOPHERPLUG_DEVICES_FILE's at any size.
DESCRIBE_DEVICES_IN_ENV = 64 * 1024


async def run_describe(resource: ResourceConfig, ids: Iterable[str]) -> tuple[dict[str, ReadValues], list[str]]:
    """Run the resource's ``describe`` once (run_program) for the devices ``ids``: what it says of
    each device (parse_description), and the IDs it described that are not among them; DescribeError
    when it cannot run, fails, times out, prints too much or no JSON object of device IDs. It is
    told the resource (GOPHERPLUG_RESOURCE) and the devices: GOPHERPLUG_DEVICES_FILE names a file of
    their comma-joined IDs (a memfd, /dev/fd/N: the pod's root file system is read-only), and
    GOPHERPLUG_DEVICES holds the same up to DESCRIBE_DEVICES_IN_ENV bytes."""
    ids, command = list(ids), resource.describe[0]
    try:
        listing = os.memfd_create("gopherplug-devices")
    except OSError as error:  # out of descriptors or memory: the node's state, no bug of ours
        raise DescribeError(f"describe: cannot run {command}: {_describe(error)}") from None
    joined = ",".join(ids)
    env = {**os.environ, "GOPHERPLUG_RESOURCE": resource.name, "GOPHERPLUG_DEVICES_FILE": f"/dev/fd/{listing}"}
    env["GOPHERPLUG_DEVICES"] = joined if len(joined.encode()) <= DESCRIBE_DEVICES_IN_ENV else ""
    try:
        with open(listing, "w", closefd=False) as file:
            file.write(joined)
        ran = await run_program(
            resource.describe, env, limit=DESCRIBE_MAX_OUTPUT, timeout=DESCRIBE_TIMEOUT, fds=(listing,)
        )
    except OSError as error:
        raise DescribeError(f"describe: cannot run {command}: {_describe(error)}") from None
    finally:
        os.close(listing)
    if ran.returncode is None or ran.stdout is None or ran.returncode != 0:
        how = f"did not finish within {DESCRIBE_TIMEOUT:g} s (killed)" if ran.returncode is None else ran.how()
        how = f"printed more than {DESCRIBE_MAX_OUTPUT} bytes (killed)" if ran.stdout is None else how
        raise DescribeError(f"describe {command} {how}{ran.said()}")
    try:
        described = parse_description(ran.stdout.decode())
    except ValueError as error:  # UnicodeDecodeError included
        raise DescribeError(f"describe {command} printed no description: {error}") from None
    return described, sorted(set(described) - set(ids))


def parse_description(text: str) -> dict[str, ReadValues]:
    """A ``describe`` program's output: one JSON object, device ID -> {"attributes": {name: value},
    "capacity": {name: quantity}}. An attribute's value is a string, a whole number, true or
    false, or DeviceAttribute's own form ({"version": "580.159.4"}, {"string": ...}, {"int": ...},
    {"bool": ...}); a capacity's a quantity ("143771Mi", or a number). Raises ValueError, with a
    reason, for anything else in the shape; each value is checked later (with_read_values), one line
    for each bad one, the others kept."""
    try:
        data = json.loads(text)
        json.dumps(data, ensure_ascii=False).encode()  # a lone surrogate ("\ud800") is no text to publish
    except json.JSONDecodeError as error:
        shown = text.strip()[:40]
        raise ValueError(f"not JSON ({error.msg} at line {error.lineno} column {error.colno}): {shown!r}") from None
    except RecursionError:
        raise ValueError("nested too deeply") from None
    except UnicodeEncodeError:
        raise ValueError("a string holds a lone surrogate (a \\uD800 to \\uDFFF escape not in a pair)") from None
    if not isinstance(data, dict):
        raise ValueError(f"a JSON object of device IDs was expected, not {type(data).__name__}")
    described = {}
    for device_id, entry in data.items():
        if not isinstance(entry, dict) or set(entry) - {"attributes", "capacity"}:
            raise ValueError(f'device {device_id!r}: expected {{"attributes": {{...}}, "capacity": {{...}}}}')
        attributes, capacity = entry.get("attributes") or {}, entry.get("capacity") or {}
        if not isinstance(attributes, dict) or not isinstance(capacity, dict):
            raise ValueError(f"device {device_id!r}: attributes and capacity must be JSON objects")
        typed: dict[str, tuple[str, Any]] = {}
        for name, value in attributes.items():
            if isinstance(value, dict) and len(value) == 1 and next(iter(value)) in ATTRIBUTE_TYPES:
                typed[name] = next(iter(value.items()))
            else:
                typed[name] = ({bool: "bool", int: "int", str: "string"}.get(type(value), ""), value)
        described[device_id] = ReadValues(typed, capacity)
    return described


async def _describe_devices(device_set: _DeviceSet) -> None:
    """Run the resource's ``describe`` whenever its devices' IDs change (and once at start), never
    on a kubelet's call, and give the device set what it said. A failure (DescribeError, or a bug
    _held_back) is said once, and again when the reason changes; the devices stay offered with what
    is known, nothing made up, and it is tried again (DESCRIBE_RETRY): a run that works is said too."""
    resource = device_set.resource
    failed = ""  # the failure last said ("": none)
    unknown_said: list[str] = []
    done_for: frozenset[str] | None = None
    retry = DESCRIBE_RETRY[0]
    while True:
        touched = device_set.ids_changed.next_touch()  # before the check: a change while it runs is not missed
        ids = device_set.ids_changed.value
        if ids != done_for and ids:
            done_for = ids
            try:
                with _held_back("describe", f"describe {resource.describe[0]}", DescribeError, logger=None):
                    described, unknown = await run_describe(resource, _natural_sorted(list(ids)))
            except DescribeError as error:
                if str(error) != failed:
                    failed = str(error)
                    kept = sum(1 for device_id in ids if device_id in device_set.described)
                    _log(resource).warning(
                        "%s; the devices are offered without what it would say (%d keep what it said before)",
                        error,
                        kept,
                    )
            else:
                if failed:
                    _log(resource).info(
                        "describe %s works again: %s described",
                        resource.describe[0],
                        _devices(len(set(described) & ids)),
                    )
                    failed = ""
                if unknown and unknown != unknown_said:
                    _log(resource).warning(
                        "describe %s described %s, which %s not among the resource's devices",
                        resource.describe[0],
                        ", ".join(unknown),
                        "is" if len(unknown) == 1 else "are",
                    )
                unknown_said = unknown
                device_set.describe_result({i: values for i, values in described.items() if i in ids})
        if not failed:
            retry = DESCRIBE_RETRY[0]
            await touched.wait()
            continue
        with trio.move_on_after(jittered(retry)):
            await touched.wait()
        if not touched.is_set():
            done_for, retry = None, min(retry * 2, DESCRIBE_RETRY[1])  # the same devices, described again


#: How often the files of a device with a value left out are read again: a file that appears after the
#: device's nodes (a board's firmware version, written once its bitstream is loaded) sends no event here.
VALUES_RETRY = 10.0


async def _read_values_again(device_set: _DeviceSet) -> None:
    while True:
        await trio.sleep(VALUES_RETRY)
        if warned := {device_id for device_id, _ in device_set.value_warned}:
            await device_set.update({}, warned)


async def _follow_source(tracker: _SourceTracker | _UsbTracker, device_set: _DeviceSet) -> None:
    """The tracker's changes, batch after batch: the next batch waits while a scan has not returned.
    What a bug raises here ends the watch, started again with a rescan (_supervised), the devices as
    known offered meanwhile."""
    async with contextlib.aclosing(tracker.watch.batches()) as batches:
        async for events, touched, rescan in batches:
            names = [name for name, _ in events]
            await device_set.update(await (tracker.rescan() if rescan else tracker.update(names, touched)))


#: The worker threads the directories' scans may hold at once, in a trio run (a source has one at a
#: time; one hung in the kernel keeps its thread, even once its watch has stopped): past them, a scan
#: waits for one, and is said to be late as a hung one is.
_SCANNERS: trio.lowlevel.RunVar[trio.CapacityLimiter | None] = trio.lowlevel.RunVar("scanners", None)


async def _looked(tracker: _SourceTracker | _UsbTracker, look: Callable[..., Any], *args: Any) -> Any:
    """``look(tracker, *args)``, a scan's reads, in a worker thread, its watches placed first (placed()): a sysfs
    file whose read never returns (a hung GPU's), a path under a dead NFS or FUSE mount, would stop the event
    loop, and with it every resource's ListAndWatch and Allocate, /healthz, SIGTERM. ``look`` writes only
    watches: the caller applies its answer on the loop, so a thread a stop (a reload, the end) abandons changes
    nothing when it returns (placed()). Late by FILE_READ_TIMEOUT, a line says so, one when it returns; the
    next batch waits. /healthz stays healthy: a restarted pod would not unhang a read in the kernel."""
    if (limiter := _SCANNERS.get()) is None:
        _SCANNERS.set(limiter := trio.CapacityLimiter(HUNG_READS))
    late = False

    async def say_late() -> None:
        nonlocal late
        await trio.sleep(FILE_READ_TIMEOUT)
        late, kept = True, f"offering its {_devices(len(tracker.found))} as known until it does"
        why = f"has not returned in {FILE_READ_TIMEOUT:g} s (a hung sysfs file or mount under it?)"
        _log(tracker.resource).warning("the scan of %s %s: %s", tracker.where, why, kept)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(say_late)
        look = functools.partial(look, tracker, *args)  # (tracker: what it reads, besides the file system)
        result = await trio.to_thread.run_sync(tracker.watch.placed, look, abandon_on_cancel=True, limiter=limiter)
        nursery.cancel_scope.cancel()
    if late:
        _log(tracker.resource).info("the scan of %s has returned", tracker.where)
    return result


def _look_at_source(tracker: _SourceTracker) -> tuple[list[str], str, Scan, int | None]:
    """A _SourceTracker's look (in a worker thread): roots and directory resolved, entries examined, again
    while a symlink's path is newly followed (unseen until now); what is at the path (directory_mistake)."""
    while True:
        roots, real = host_path_roots(tracker.resource, tracker.dev_root), os.path.realpath(tracker.source.directory)
        scan = scan_source(tracker.resource, tracker.source, roots, tracker.sysfs_root)
        if scan.unknown or not tracker.watch.follow(scan.followed):
            return roots, real, scan, _mode(tracker.source.directory)


def _examined(
    tracker: _SourceTracker, pointing: dict[str, set[str]] | None, names: list[str]
) -> tuple[list[str], list[DeviceEntry | str | None]]:
    """A batch's entries examined (in a worker thread): one hop a batch, not one an entry. With ``pointing``
    (a symlink came or changed): its paths followed, then the entries that lead to one newly watched."""
    if pointing is not None:
        names = list(dict.fromkeys(name for path in tracker.watch.follow(pointing) for name in pointing[path]))
    resource, source, roots, sysfs_root = tracker.resource, tracker.source, tracker.roots, tracker.sysfs_root
    return names, [examine_entry(resource, source, name, roots, sysfs_root) for name in names]


def _look_at_usb(tracker: _UsbTracker) -> Scan:
    """A _UsbTracker's look (in a worker thread): the nodes, their directories watched (and looked again if new)."""
    dev_root, buses = tracker.dev_root, os.path.join(tracker.dev_root, "bus", "usb")
    while True:
        try:
            numbered = [os.path.join(buses, name) for name in os.listdir(buses)]
        except OSError:
            numbered = []  # no USB bus (yet): /dev/bus/usb appearing is watched
        scan = scan_usb(tracker.resource, host_path_roots(tracker.resource, dev_root), tracker.sysfs_root, dev_root)
        if not tracker.watch.watch_also([os.path.join(dev_root, "bus"), buses, *numbered, f"{dev_root}/input"]):
            return scan


async def _follow_turn(turn: CDISpecTurn, device_set: _DeviceSet) -> None:
    while True:
        touched = turn.changed.next_touch()  # before the check: a change while it runs is not missed
        device_set.check_turn()
        await touched.wait()


# An entry's key in a _DeviceSet: its source's number and its name in that directory (a USB
# device's node: the number after the sources', and its path).
_Key = tuple[int, str]


class _SourceTracker:
    """watch_devices' bookkeeping for one source: what its directory holds, the warnings it gave,
    and which symlinks each followed path decides on. It reports what changed, as entries by key
    (None: gone), for the _DeviceSet to make into devices."""

    def __init__(
        self,
        resource: ResourceConfig,
        number: int,
        source: Source,
        watch: DirectoryWatch,
        sysfs_root: str,
        dev_root: str,
    ) -> None:
        self.resource, self.number, self.source, self.watch = resource, number, source, watch
        self.sysfs_root, self.dev_root = sysfs_root, dev_root
        self.roots: list[str] = []  # resolved, with real_directory, by each rescan (the first is before any update)
        self.real_directory = ""
        self.found: dict[str, DeviceEntry] = {}  # the directory's entries by name, as last examined
        self.pointing: dict[str, set[str]] = {}  # followed path -> the entries whose symlinks lead there
        # Each followed path and each of its ancestors -> the entries whose symlinks lead there or
        # below: a batch touching T paths finds its entries in T lookups, where comparing every
        # touched path with every followed one cost T x P (a burst of 10,000 events next to 10,000
        # symlinks: 100 million comparisons on the one event loop).
        self.under: dict[str, collections.Counter[str]] = {}
        self.warned: dict[str, str] = {}  # skipped entry name -> why, as last warned
        self.problem = ""  # why the directory could not be read, as last warned
        self.where = source.directory  # what its scan reads, for the log (_looked)

    async def rescan(self) -> dict[_Key, DeviceEntry | None]:
        """Look at every entry again."""
        first = not self.real_directory
        self.roots, self.real_directory, scan, mode = await _looked(self, _look_at_source)
        if first and not self.watch.exists:
            missing = f"{self.source.directory} is not a directory (yet): no devices until it is"
            _log(self.resource).warning("%s", directory_mistake(self.source.directory, mode) or missing)
        if scan.problem and scan.problem != self.problem:
            kept = f"keeping its {_devices(len(self.found))} as known, trying again every {INOTIFY_RETRY_INTERVAL:g} s"
            _log(self.resource).warning("%s: %s", scan.problem, kept if scan.unknown else "no devices until it can")
        elif self.problem and not scan.problem:
            _log(self.resource).info("%s can be read again", self.source.directory)
        self.problem = scan.problem
        if scan.unknown:
            self.watch.again(INOTIFY_RETRY_INTERVAL)
            return {}
        _warn_skipped_now(self.resource, self.warned, scan.skipped)
        before, self.found = self.found, {os.path.basename(entry.path): entry for entry in scan.devices}
        self.pointing, self.under = {}, {}
        for name, entry in self.found.items():
            self._index(name, (), entry.followed)
        return _replaced(self.number, before, self.found)

    async def update(self, names: list[str], touched: Iterable[str] = ()) -> dict[_Key, DeviceEntry | None]:
        """Look again at these entries only, and at the symlinks that lead through them or through
        the ``touched`` paths (or under them)."""
        examine = dict.fromkeys(names)
        touched = {*touched, *(os.path.join(self.real_directory, name) for name in names)}
        for path in touched:
            examine.update(dict.fromkeys(self.under.get(path, ())))
        _, links_changed = await self._examine(list(examine))
        for _ in range(3):  # a symlink came or changed: watch where it leads, then look at it again
            if not links_changed:
                break
            more, links_changed = await self._examine([], self.pointing)
            examine.update(dict.fromkeys(more))
        else:
            return await self.rescan()  # links that keep changing under us: look at everything
        return {(self.number, name): self.found.get(name) for name in examine}

    async def _examine(self, names: list[str], pointing: dict[str, set[str]] | None = None) -> tuple[list[str], bool]:
        """Examine these entries again, or with ``pointing`` those that lead to a path newly followed (in one
        worker thread: _examined); return which, and whether a symlink's path changed."""
        names, results = await _looked(self, _examined, pointing, names) if names or pointing is not None else ([], [])
        links_changed = False
        for name, result in zip(names, results, strict=True):
            old = self.found.get(name)
            if isinstance(result, DeviceEntry):
                self.found[name] = result
            else:
                self.found.pop(name, None)
            _warn_skipped(self.resource, self.warned, name, result if isinstance(result, str) else None)
            old_paths = old.followed if old is not None else ()
            new_paths = result.followed if isinstance(result, DeviceEntry) else ()
            if old_paths != new_paths:
                self._index(name, old_paths, new_paths)
                links_changed = True
        return names, links_changed

    def _index(self, name: str, old_paths: Iterable[str], new_paths: Iterable[str]) -> None:
        for path in old_paths:
            self.pointing[path].discard(name)
            if not self.pointing[path]:
                del self.pointing[path]
            for ancestor in _self_and_ancestors(path):
                counts = self.under[ancestor]
                counts[name] -= 1
                if counts[name] <= 0:
                    del counts[name]
                    if not counts:
                        del self.under[ancestor]
        for path in new_paths:
            self.pointing.setdefault(path, set()).add(name)
            for ancestor in _self_and_ancestors(path):
                self.under.setdefault(ancestor, collections.Counter())[name] += 1


def _replaced(
    number: int, before: Mapping[str, DeviceEntry], now: Mapping[str, DeviceEntry]
) -> dict[_Key, DeviceEntry | None]:
    """The changes, by key, that replace a source's entries ``before`` with those found ``now``."""
    changes: dict[_Key, DeviceEntry | None] = {(number, name): None for name in before}
    changes.update({(number, name): entry for name, entry in now.items()})
    return changes


def _warn_skipped_now(resource: ResourceConfig, warned: dict[str, str], skipped: Iterable[tuple[str, str]]) -> None:
    """After a rescan: warn about what is skipped now, and forget what no longer is (a name
    that comes back is warned about again)."""
    now = dict(skipped)
    for name in set(warned) - set(now):
        del warned[name]
    for name, why in now.items():
        _warn_skipped(resource, warned, name, why)


def _warn_skipped(resource: ResourceConfig, warned: dict[str, str], name: str, why: str | None) -> None:
    """Warn that an entry is skipped: once per name and reason."""
    if why is None:
        warned.pop(name, None)
    elif warned.get(name) != why:
        _log(resource).warning("skipping %r: %s", name, why)
        warned[name] = why


class _UsbTracker:
    """watch_devices' bookkeeping for the resource's USB devices: their nodes, as sysfs last said.

    sysfs sends no inotify events. Its watch is on /dev (``dev_root``), and also on /dev/bus,
    /dev/bus/usb and each bus's directory in it, and on /dev/input: where the kernel makes the
    nodes of a USB device when it is plugged in, and of its interfaces (ttyUSB0, hidraw0, video0)
    when a driver takes them. Any event there reads sysfs again: a couple of hundred small reads."""

    def __init__(self, resource: ResourceConfig, watch: DirectoryWatch, sysfs_root: str, dev_root: str) -> None:
        self.resource, self.number, self.watch = resource, len(resource.sources), watch
        self.sysfs_root, self.dev_root = sysfs_root, dev_root
        self.found: dict[str, DeviceEntry] = {}  # node path -> its entry
        self.warned: dict[str, str] = {}
        self.where = os.path.join(sysfs_root, "bus", "usb", "devices")  # (see _SourceTracker)

    async def rescan(self) -> dict[_Key, DeviceEntry | None]:
        scan = await _looked(self, _look_at_usb)
        _warn_skipped_now(self.resource, self.warned, scan.skipped)
        before, self.found = self.found, {entry.path: entry for entry in scan.devices}
        return _replaced(self.number, before, self.found)

    async def update(self, names: list[str], touched: Iterable[str] = ()) -> dict[_Key, DeviceEntry | None]:
        """Whatever the event was about: sysfs is read again (it tells which nodes are whose)."""
        return await self.rescan()


class _DeviceSet:
    """watch_devices' devices: the entries its sources found, made into devices (entries with the
    same ID are one), published, their health changes logged, their CDI spec written."""

    def __init__(
        self,
        resource: ResourceConfig,
        devices: Watched,
        turn: CDISpecTurn | None = None,
        described: dict[str, ReadValues] | None = None,
        written: dict[str, Any] | None = None,
    ) -> None:
        self.resource = resource
        self.devices = devices
        self.turn = turn  # with a DRA driver: the spec is written in this pod's turn only
        self.taken = turn.changed.value if turn is not None else 0  # the turn's take() count last seen
        self.deferred_to = ""  # the newer pod's registration socket the spec is left to ("": written here)
        self.entries: dict[str, dict[_Key, DeviceEntry]] = {}  # device ID -> its entries
        self.ids: dict[_Key, str] = {}  # an entry's key -> its device's ID
        self.found: dict[str, DeviceEntry] = {}  # the devices, as last made
        self.cdi_written: Any = _NOT_YET  # the spec last written (None: the file removed)
        self.cdi_failed = False  # the last write failed: devices are held back until one succeeds
        #: spec file -> the spec last written there, kept across watches as ``described`` is: a watch
        #: started again (a reload, a refused one's old configuration) does not write it again
        self.written: dict[str, Any] = written if written is not None else {}
        self.watches: list[DirectoryWatch] = []  # what looks at the devices again after a failed write
        self.empty: bool | None = None  # whether nothing was found at the last publish (None: none yet)
        self.bare: dict[str, DeviceEntry] = {}  # device ID -> the device as found, before what was read for it
        self.files: dict[str, ReadValues] = {}  # device ID -> what its attributes' and capacity's files said
        #: device ID -> what describe said of it, the last time it worked: a dict that outlives this
        #: device set when the caller keeps it (a reload's new watch starts with what is known)
        self.described: dict[str, ReadValues] = described if described is not None else {}
        self.value_warned: dict[tuple[str, str], str] = {}  # (device ID, key) -> why its value is left out
        #: touched when the devices' IDs change: describe runs again (_describe_devices)
        self.ids_changed = Watched(frozenset[str]())
        self.updating = trio.Lock()

    def _with_values(
        self, device: DeviceEntry, read: tuple[ReadValues, list[tuple[str, str]]] | None = None
    ) -> DeviceEntry:
        """The device with what its files (``read`` again, if given) and describe said of it;
        each value left out said once (and again if the reason changes)."""
        if not (self.resource.attributes or self.resource.capacity or self.resource.describe):
            if not (device.attributes or device.capacity):
                return device  # nothing declared: the scan's path stays as it was
        problems: list[tuple[str, str]] = []
        kept = self.found.get(device.id)  # after a bug met by what was read: the values it had (new: none)
        entry = (
            device if kept is None else dataclasses.replace(device, attributes=kept.attributes, capacity=kept.capacity)
        )
        more: list[tuple[str, str]] = []
        with _held_back("values", f"device {device.id}'s attributes and capacity", logger=_log(self.resource)):
            if read is not None:
                self.files[device.id], problems = read
                problems = [(key, f"{why} (read again every {VALUES_RETRY:g} s until it is)") for key, why in problems]
            entry, more = with_read_values(
                self.resource, device, self.files.get(device.id, ReadValues()), self.described.get(device.id)
            )
        now = dict(problems + more)
        for warned in [warned for warned in self.value_warned if warned[0] == device.id and warned[1] not in now]:
            del self.value_warned[warned]
        for key, why in now.items():
            if self.value_warned.get((device.id, key)) != why:
                self.value_warned[(device.id, key)] = why
                _log(self.resource).warning("device %s: %s: %s", device.id, key, why)
        return entry

    def describe_result(self, described: dict[str, ReadValues]) -> None:
        """What describe said, by device ID: every device carries it from now on."""
        if self.devices.value is RETIRED:
            return
        self.described.clear()
        self.described.update(described)
        for device_id in self.found:
            self.found[device_id] = self._with_values(self.bare[device_id])
        self._publish(set(self.found))

    async def update(self, changes: Mapping[_Key, DeviceEntry | None], reread: Iterable[str] = ()) -> None:
        """Take these entries (None: gone) and publish the devices they make (and ``reread``'s, files read again)."""
        async with self.updating:  # one at a time: the values read meanwhile are of these entries
            if self.devices.value is not RETIRED:  # else removed from the configuration: its goodbye stands
                await self._update(changes, reread)

    def _read_files(self, devices: list[DeviceEntry]) -> dict[str, tuple[ReadValues, list[tuple[str, str]]]]:
        """read_declared_values for each device (in a worker thread); one a bug met is left out."""
        read = {}
        for device in devices:
            with _held_back("values", f"device {device.id}'s attributes and capacity", logger=_log(self.resource)):
                read[device.id] = read_declared_values(self.resource, device)
        return read

    async def _update(self, changes: Mapping[_Key, DeviceEntry | None], reread: Iterable[str]) -> None:
        changed: set[str] = set(reread)
        for key, entry in changes.items():
            old_id = self.ids.pop(key, None)
            if old_id is not None:
                del self.entries[old_id][key]
                changed.add(old_id)
            if entry is not None:
                self.ids[key] = entry.id
                self.entries.setdefault(entry.id, {})[key] = entry
                changed.add(entry.id)
        made = {i: merge_entries(list(entries.values())) for i in changed if (entries := self.entries.get(i))}
        read = {}
        if any(declared.file for declared in (*self.resource.attributes, *self.resource.capacity)):
            # Off the event loop: a file may be slow to answer, or never (each read has its deadline).
            read = await trio.to_thread.run_sync(self._read_files, list(made.values()), abandon_on_cancel=True)
        for device_id in _natural_sorted(list(changed)):  # a new device joins the list in natural order
            if bare := made.get(device_id):
                if self.resource.describe:
                    self.bare[device_id] = bare
                self.found[device_id] = self._with_values(bare, read.get(device_id, (ReadValues(), [])))
            else:
                self.entries.pop(device_id, None)
                self.found.pop(device_id, None)
                self.files.pop(device_id, None)
                self.bare.pop(device_id, None)
                for warned in [warned for warned in self.value_warned if warned[0] == device_id]:
                    del self.value_warned[warned]
        if self.resource.describe and (ids := frozenset(self.found)) != self.ids_changed.value:
            self.ids_changed.set(ids)
        self._publish(changed)

    def check_turn(self) -> None:
        """The turn changed (CDISpecTurn): write the spec again if this pod took it, or if it had
        left the spec to a newer pod (which may be gone); written or not, write_cdi_spec decides."""
        assert self.turn is not None
        taken, self.taken = self.turn.changed.value != self.taken, self.turn.changed.value
        if self.devices.value is not RETIRED and (taken or self.deferred_to):
            self._publish(set(), rewrite=True)

    def _publish(self, changed: set[str], rewrite: bool = False) -> None:
        """Publish what was found (a copy: streams hold on to it), log health changes of the
        ``changed`` devices, write the CDI spec (``rewrite``: even if it is as last written)."""
        before = self.devices.value
        _log_health_changes(self.resource, before, self.found, changed)
        found = dict(self.found)
        # The spec describes device nodes and mounts: a change of health alone leaves it as it is
        # (and at 50,000 devices, building and comparing it costs half a second).
        if self.resource.cdi is not None and (
            self.cdi_written is _NOT_YET
            or self.cdi_failed
            or rewrite
            or any(_cdi_part(before.get(i)) != _cdi_part(self.found.get(i)) for i in changed)
        ):
            found = self._write_cdi_spec(found, rewrite)
        if found != before:
            self.devices.replace(found)
            if _metrics is not None:
                _metrics.set_devices(self.resource.name, found)
        # Nothing found is worth a warning, once: at start (a pattern that matches nothing, a USB
        # key not plugged in, a machine with no USB; again after a reload applied in place, whose
        # watch looks afresh) and whenever the last device goes, not at each rescan that finds
        # nothing again. The line when devices come back says how many.
        if not self.found and self.empty is not True:
            _log(self.resource).warning("no device from %s: none is offered until one appears", self.resource.origin())
        elif found != before:
            # After the first list, which devices came and went (hot-plug): the count alone does not
            # say which. Only when the set of IDs changed; a change of health has its own line.
            changes = _came_and_went(before, found) if self.empty is not None else ""
            _log(self.resource).info("%s from %s%s", _devices(len(found)), self.resource.origin(), changes)
        self.empty = not self.found

    def _write_cdi_spec(self, found: dict[str, DeviceEntry], rewrite: bool = False) -> dict[str, DeviceEntry]:
        """Write the spec for ``found``; return the devices that may be offered (those it describes)."""
        assert self.resource.cdi is not None
        spec = cdi_spec(self.resource, found.values())
        if self.cdi_written is _NOT_YET and spec == self.written.get(self.resource.cdi.spec_file, _NOT_YET):
            self.cdi_written = spec  # as this resource's last watch left it (a CDISpecTurn change rewrites it)
        if spec == self.cdi_written and not rewrite and not self.deferred_to:
            return found
        try:
            yield_to = self.turn.newer if self.turn is not None else None
            newer = write_cdi_spec(self.resource.cdi, spec, yield_to)
            if newer:
                # A newer pod of the driver writes the spec from its own configuration: every
                # device is offered here (the newer pod publishes the slices and prepares new claims).
                if newer != self.deferred_to:
                    _log(self.resource).info(
                        "a newer pod of the DRA driver serves (%s): the CDI spec %s is left to it",
                        newer,
                        self.resource.cdi.spec_file,
                    )
                self.deferred_to, self.cdi_failed = newer, False
                if self.cdi_written is _NOT_YET:
                    self.cdi_written = None  # not a start that failed: later failures are logged, not raised
                return found
            if self.deferred_to:
                _log(self.resource).info(
                    "no newer pod of the DRA driver serves any more: writing the CDI spec %s again",
                    self.resource.cdi.spec_file,
                )
            self.deferred_to = ""
            self.cdi_written = self.written[self.resource.cdi.spec_file] = spec
            self.cdi_failed = False
            return found
        except GopherplugError as error:
            if self.cdi_written is _NOT_YET:
                raise  # at start: stop with that one line
            # Later (a full disk, say): a device the runtime cannot resolve must not be offered.
            described = {device["name"] for device in (self.cdi_written or {}).get("devices", [])}
            if not self.cdi_failed:  # once, not at each try
                _log(self.resource).error("%s; offering only the devices it describes until it can be written", error)
            self.cdi_failed = True
            for watch in self.watches:
                watch.again(INOTIFY_RETRY_INTERVAL)
            return {device_id: device for device_id, device in found.items() if device_id in described}


def _log_health_changes(
    resource: ResourceConfig, before: Mapping[str, DeviceEntry], now: Mapping[str, DeviceEntry], ids: Iterable[str]
) -> None:
    """Log each of the devices ``ids`` whose health changed from ``before`` to ``now``: a warning
    with the reason when it is unhealthy (new, turned so, or for another reason), a line when it is
    healthy again. A device that comes healthy, or goes, is in the count line instead.

    The kubelet logs none of this (it counts a resource's healthy devices in the node's status): the
    plugin's log is where an operator learns which device went, and why. The same lines whether the
    devices come from a directory (_DeviceSet) or from an embedding program (serve_devices)."""
    for device_id in ids:
        device, old = now.get(device_id), before.get(device_id)
        if device is None:
            continue
        if device.health != HEALTHY and (old is None or old.problem != device.problem or old.health == HEALTHY):
            reason = f": {device.problem}" if device.problem else " (no reason given)"
            _log(resource).warning("%s is unhealthy%s", device.id, reason)
        elif device.health == HEALTHY and old is not None and old.health != HEALTHY:
            _log(resource).info("%s is healthy again", device.id)


_NOT_YET = object()


def _self_and_ancestors(path: str) -> Iterator[str]:
    """ "/a/b/c", "/a/b", "/a", "/"."""
    while True:
        yield path
        parent = os.path.dirname(path)
        if parent == path:
            return
        path = parent


def _cdi_part(device: DeviceEntry | None) -> Any:
    """What of a device its CDI description depends on."""
    return None if device is None else (device.path, device.device_specs, device.mounts)


def _replace_whole(
    path: str, text: str, prefix: str, mode: int | None = None, *, durable: bool = True
) -> os.stat_result:
    """Write ``text`` to ``path`` whole: a temporary file beside it (named ``prefix``...``.tmp``,
    which CDI runtimes watching a spec directory ignore), on the disk first if ``durable``, then
    renamed over ``path``, so a reader (a runtime, a container, our next start) never sees half of
    it. Returns the new file's status; raises OSError, leaving no temporary file behind."""
    fd, temporary = tempfile.mkstemp(dir=os.path.dirname(path), prefix=prefix, suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            if durable:
                os.fsync(file.fileno())
            if mode is not None:
                os.fchmod(file.fileno(), mode)
            status = os.fstat(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    return status


def write_cdi_spec(cdi: CDIConfig, spec: dict[str, Any] | None, yield_to: Callable[[], str] | None = None) -> str:
    """Replace the CDI spec file atomically (a runtime never reads half a file), or remove it (None).
    Returns "", or what ``yield_to`` named: then nothing was written.

    Raises GopherplugError when the directory cannot be written: the kubelet would hand out CDI
    devices that no runtime can find.

    Written under an flock on ``cdi.lock_file``, held for this write only: during a rolling update
    the DaemonSet's old and new pod both run, and neither may keep the other from starting. The
    lock file stays: an flock on a file removed and made again could have two holders. So it is
    one per kind, shared by the claims' specs of that kind (a lock file per claim would be left
    behind by every claim ever prepared). ``yield_to`` (CDISpecTurn.newer) is asked under the
    flock: a newer pod that took its turn under it before is seen listening now, and one that takes
    it after this write writes last."""
    try:
        os.makedirs(cdi.spec_dir, mode=0o755, exist_ok=True)
        lock = os.open(cdi.lock_file, _LOCK_FLAGS, 0o600)
        try:
            # The other holder writes one file, in milliseconds: waited for here, on the event loop.
            fcntl.flock(lock, fcntl.LOCK_EX)
            if yield_to is not None and (newer := yield_to()):
                return newer
            if spec is None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(cdi.spec_file)
                return ""
            # A name without .json or .yaml: CDI runtimes watching the directory ignore it until renamed.
            # Not forced to the disk: every start writes the spec again from the devices it finds.
            _replace_whole(cdi.spec_file, _cdi_json(spec), ".gopherplug-", 0o644, durable=False)
            return ""
        finally:
            os.close(lock)
    except OSError as error:
        raise GopherplugError(f"cannot write the CDI spec {cdi.spec_file}: {_describe(error)}") from None


#: How a lock file is opened: made if missing, never through a symlink, not inherited by a pre_start command.
_LOCK_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC


def _cdi_json(spec: Mapping[str, Any]) -> str:
    """The spec as JSON with one device a line: a person can still read and grep it, and every part
    goes through the json module's C encoder (an indented file goes through its Python one, three
    times slower: 180 ms a write at 10,000 devices, at every device that comes or goes)."""
    head = json.dumps({key: value for key, value in spec.items() if key != "devices"})[:-1]
    devices = ",\n    ".join(json.dumps(device) for device in spec["devices"])
    return f'{head}, "devices": [\n    {devices}\n  ]}}\n'


class CDISpecTurn:
    """Whose turn it is to write the CDI specs (<vendor>-<class>.json) that the pods of a DRA driver
    share on a node: one writer, the newest pod, as for the slices (DriverPeers).

    During a rolling update the DaemonSet's old and new pod both watch the devices, and each would
    write the spec from its own configuration (env, mounts, device_specs): the last write wins, so
    a spec the old pod wrote could outlive it, and containers the new pod prepares would get the old
    settings until its own devices next changed. So a pod writes only while ``newer()`` names no
    newer live pod of the driver (its registration socket, as DriverPeers.newer; "" until serve_dra
    listens on ours, so a pod writes at start), and writes again once that pod is gone.

    serve_dra calls ``take(newer)`` once its registration socket listens: each resource's spec is
    then written again, under the flock (write_cdi_spec), whatever an older pod wrote before it saw
    this one. ``changed`` is also touched whenever a socket comes or goes in plugins_registry: an
    older pod that left the spec to a newer one writes it again once that one is gone."""

    def __init__(self) -> None:
        self.newer: Callable[[], str] = str  #: the registration socket of a newer live pod ("": none)
        self.changed = Watched(0)  #: counts take(); touched when a peer may have come or gone

    def take(self, newer: Callable[[], str]) -> None:
        """This pod's registration socket listens: ask ``newer`` from now on, and write every spec again."""
        self.newer = newer
        self.changed.set(self.changed.value + 1)


# 6b. The DevicePlugin service and registration --------------------------------------------------------
class KubeletWatch:
    """What inotify says about the kubelet's device-plugin directory.

    ``generation`` counts the kubelet.sock files created since we started watching: every kubelet
    (re)start creates one, and each calls for a new registration. ``current()`` says whether
    kubelet.sock is there, and of which generation. ``changed`` is touched on every event in the
    directory, so that each resource can check whether its own socket is still there."""

    def __init__(self, device_plugin_dir: str) -> None:
        self.device_plugin_dir = device_plugin_dir
        self.kubelet_socket = os.path.join(device_plugin_dir, KUBELET_SOCKET)
        self.generation = 0
        self.changed = Watched(None)
        self._watch: DirectoryWatch | None = None
        self._present = False  # whether kubelet.sock is there, by the events taken so far
        self._seen: tuple[int, int] | None = None  # which file it was at the last look, for a rescan
        self._watched = False  # whether it ran before (and failed: started again)

    def current(self) -> int | None:
        """The generation of the kubelet.sock there now, or None while there is none: what the
        kernel has queued until now taken first, so that this is up to date.

        Register under this generation, read just before the call. A kubelet can answer only once
        it listens, after bind() queued kubelet.sock's IN_CREATE: whichever kubelet the call then
        reaches is counted already, or started after this, wiping our socket (its dial-back fails).
        The generation alone would lag behind inotify's queue: a registration made with a new
        kubelet under the generation before it looked outdated once the event came, and was made
        again, a second one for the same kubelet."""
        batch = self._watch.pending() if self._watch is not None else None
        if batch is not None:
            events, _, rescan = batch
            self._take(events, rescan)
        return self.generation if self._present else None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Watch until cancelled."""
        with DirectoryWatch(
            self.device_plugin_dir, flags.CREATE | flags.DELETE | flags.MOVED_FROM | flags.MOVED_TO
        ) as w:
            # Looked at once the watch is placed: a kubelet.sock made from now on is reported too,
            # even one made before this look, which _take() then knows to be the same. Started
            # again after a failure (_supervised), the look is a rescan: a kubelet restarted meanwhile counts.
            if self._watched:
                self._take([], rescan=True)
            self._seen = self._file()
            self._present, self._watched = self._seen is not None, True
            self._watch = w
            try:
                task_status.started()
                async with contextlib.aclosing(w.batches()) as batches:
                    async for events, _, rescan in batches:
                        self._take(events, rescan)
            finally:
                self._watch = None

    def _take(self, events: list[tuple[str, int]], rescan: bool) -> None:
        # kubelet.sock's own events come in order, each creation after a deletion: one that finds
        # it present already is about the file we have (made between the watch and our first
        # look), not a new kubelet. A rescan means events were lost: the file there says then.
        new = False
        for name, mask in events:
            if name == KUBELET_SOCKET:
                created = bool(mask & (flags.CREATE | flags.MOVED_TO))
                new = new or (created and not self._present)
                self._present = created
        now = self._file()
        if rescan:
            new = new or (now is not None and (not self._present or now != self._seen))
            self._present = now is not None
        self._seen = now
        if new:
            self.generation += 1
            if _metrics is not None:
                _metrics.kubelet_restarts.inc()
            log.info("kubelet.sock created in %s: the kubelet (re)started", self.device_plugin_dir)
        self.changed.touch()

    def _file(self) -> tuple[int, int] | None:
        # Which file kubelet.sock is: device and inode number. Not the change time: anyio changes
        # it right after bind() (chmod), so the same socket would look new to a later rescan.
        identity = _identity(self.kubelet_socket)
        return None if identity is None else identity[:2]


#: The device set of a resource being removed from the configuration: its ListAndWatch streams
#: send this empty list (the kubelet drops the capacity to zero at once), then end.
RETIRED: Mapping[str, DeviceEntry] = types.MappingProxyType({})


class _RepeatedMessages(Protocol):
    """A repeated message field (a response's mounts, devices, cdi_devices) as a type checker sees
    it: add(**fields) appends an element with those fields and returns it."""

    def add(self, **fields: Any) -> Any: ...

    def __iter__(self) -> Iterator[Any]: ...

    def __len__(self) -> int: ...


class ContainerAllocateResponse(Protocol):
    """v1beta1.ContainerAllocateResponse as a type checker sees it, for ShapeAllocation hooks.

    The message classes of section 1 are built when the module is imported, from descriptors, so
    no type checker can see their fields: this Protocol names them. At run time the hook gets the
    message itself (v1beta1.ContainerAllocateResponse), whose maps and repeated fields work so."""

    envs: MutableMapping[str, str]
    annotations: MutableMapping[str, str]
    mounts: _RepeatedMessages  # Mount: container_path, host_path, read_only
    devices: _RepeatedMessages  # DeviceSpec: container_path, host_path, permissions ("rw", "rwm"...)
    cdi_devices: _RepeatedMessages  # CDIDevice: name, fully qualified (vendor.com/class=name)


#: An embedder's hook: called with a container's devices and the ContainerAllocateResponse that
#: gopherplug filled in, to add to it or change it; may be a coroutine function.
ShapeAllocation = Callable[[list[DeviceEntry], ContainerAllocateResponse], Awaitable[None] | None]


class _Encoded:
    """A message already serialized: purerpc sends what SerializeToString() returns."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def SerializeToString(self) -> bytes:  # noqa: N802 - protobuf's name
        return self.data


class _ListEncoder:
    """ListAndWatch messages for one resource, encoding again only the devices that changed.

    Building a protobuf message costs about 2.5 us per device: 125 ms for 50,000, on every change.
    But a serialized message is the concatenation of its fields' encodings, so a one-device
    ListAndWatchResponse, serialized, is exactly that device's part of any list: those parts are
    kept per device and joined, and only a new or changed device is encoded again."""

    def __init__(self, resource: ResourceConfig) -> None:
        self.resource = resource
        self._parts: dict[str, tuple[DeviceEntry, bytes]] = {}
        # The last list encoded and its message: every stream of the resource sends that same object
        # (the device sets are never changed in place, a change is a new mapping). Many streams that
        # wait for a peer to read (SEND_QUEUE_LIMIT) then hold one message between them, not one each.
        self._last: tuple[Mapping[str, DeviceEntry], _Encoded] | None = None

    def encode(self, devices: Mapping[str, DeviceEntry], resource: ResourceConfig | None = None) -> _Encoded:
        if resource is not None and resource is not self.resource:
            self.resource, self._parts = resource, {}  # a reload applied in place: the replicas may differ
            self._last = None
        if self._last is not None and self._last[0] is devices:
            return self._last[1]
        parts = {}
        for device in devices.values():
            known = self._parts.get(device.id)
            if known is not None and (known[0] is device or known[0] == device):
                parts[device.id] = known
            else:
                parts[device.id] = (device, list_and_watch_response(self.resource, [device]).SerializeToString())
        self._parts = parts
        encoded = _Encoded(b"".join(part for _, part in parts.values()))
        self._last = (devices, encoded)
        return encoded


#: The request header `gopherplug probe` sends with its own ListAndWatch: a probe's stream is not
#: the kubelet's, and must not count as one.
PROBE_METADATA = ("gopherplug-probe", "1")

#: How long a resource may go without a ListAndWatch stream from a running kubelet before the probe
#: fails. The kubelet opens the stream within milliseconds of Register; a kubelet that never
#: registered a plugin again (kubernetes issue #125501: resources stuck at 0) never opens one.
PROBE_STREAM_GRACE = 60.0


@dataclass
class StreamStatus:
    """Whether the kubelet uses a resource's devices: registered, and reading a ListAndWatch stream.

    Kept by serve_resource (registration, each kubelet) and the ListAndWatch handler (streams);
    answered by the status service. Times are time.monotonic()."""

    registered: bool = False
    streams: int = 0  #: the kubelet's ListAndWatch streams open now
    unstreamed_since: float = dataclasses.field(default_factory=time.monotonic)  #: when the last one ended
    #: For the liveness check (problem()): the server of the socket registered last, and the kubelet
    #: generation it was registered with (None: not registered with any yet, in this generation).
    server: GRPCServer | None = None
    registered_with: int | None = None
    stream_failed: bool = False  #: a kubelet's stream ended by a failure: its registration is gone with it

    def new_kubelet(self) -> None:
        """A (re)started kubelet, or our socket gone: not registered, and the wait for a stream starts now."""
        self.registered = self.stream_failed = False
        self.registered_with = None
        if not self.streams:
            self.unstreamed_since = time.monotonic()

    def stream_ended(self) -> None:
        self.streams -= 1
        if not self.streams:
            self.unstreamed_since = time.monotonic()

    def problem(self, kubelet: KubeletWatch, grace: float | None = None) -> str:
        """Why the kubelet running now is not using this resource ("" when it is): the liveness
        check's answer, from what the process knows (a stat() of our socket, inotify's queue on
        kubelet.sock), no socket dialed. See Health."""
        server = self.server
        if server is None:
            return "not serving yet"
        if not server.owns_socket_file():
            return f"its socket {server.socket_path} was deleted or replaced (serving it again)"
        now = kubelet.current()  # inotify's queue taken first: a kubelet restart a moment ago counts
        if self.registered_with is None:
            if self.streams and now is not None:
                # The kubelet opens ListAndWatch on this generation's socket once it has accepted
                # Register, from its own goroutine: the stream can be open before Register's answer
                # reaches us. A kubelet streaming our devices has registered us.
                return ""
            waiting = "" if now is not None else f", which is not running (no {kubelet.kubelet_socket})"
            return f"not registered with the kubelet{waiting}"
        if now is None:
            return f"the kubelet it registered with stopped (no {kubelet.kubelet_socket})"
        if now != self.registered_with:
            return "the kubelet restarted since it registered: not registered with the one running now"
        unstreamed = time.monotonic() - self.unstreamed_since
        if not self.streams and unstreamed > (PROBE_STREAM_GRACE if grace is None else grace):
            return f"registered, but the kubelet has opened no ListAndWatch stream for {unstreamed:.0f} s"
        return ""

    def message(self, resource_name: str) -> Any:
        unstreamed = 0.0 if self.streams else time.monotonic() - self.unstreamed_since
        return ResourceStatus(
            resource_name=resource_name, registered=self.registered, streams=self.streams, unstreamed_seconds=unstreamed
        )


def status_service(message: Callable[[], Any]) -> purerpc.Service:
    """gopherplug's status service, on the same socket as a DevicePlugin or DRAPlugin service:
    ``message()`` is the ResourceStatus it answers."""

    async def get(empty: Any) -> Any:
        return message()

    service = purerpc.Service(GET_STATUS.service)
    service.add_method(GET_STATUS.name, get, GET_STATUS.signature)
    return service


class DevicePluginService:
    """The DevicePlugin service for one resource, answering from the live device set: one method
    per RPC of v1beta1, in the order the kubelet calls them.

    Its ListAndWatch streams end (status OK) once ``ending`` is set and ``devices`` touched (which
    wakes them: one event to wait on keeps each push cheap). With ``examine`` (a
    device ID -> what examine_entry says of it now), Allocate and PreStartContainer look at the
    devices they are asked for again instead of trusting the set inotify last published;
    ``examiner(off_loop)``, instead, gives an Allocate's or PreStartContainer's ``examine`` (the roots resolved
    once per call), or None when that may hang unless ``off_loop``: then it runs in a thread (_found_now).
    ``status`` counts the kubelet's ListAndWatch streams. ``config``, if given, holds the
    resource's configuration as reloads change it in place (same name, same options): every answer
    follows it from then on, and a stream sends the list anew once ``devices`` is replaced
    (unless the kubelet's list it makes is the one that stream sent last).

    service() makes it a purerpc service; the speed-ups live there and in what the methods call
    (_ImmediateService, _ListEncoder, _PreferredOrder and _PreferredAllocationWire): a lesson may
    skip them, as the answers are the same without."""

    def __init__(
        self,
        resource: ResourceConfig,
        devices: Watched,
        shape_allocation: ShapeAllocation | None = None,
        encoder: _ListEncoder | None = None,
        ending: trio.Event | None = None,
        examine: Callable[[DeviceEntry], DeviceEntry | str | None] | None = None,
        status: StreamStatus | None = None,
        *,
        config: Watched | None = None,
        examiner: Callable[[bool], Callable[[DeviceEntry], DeviceEntry | str | None] | None] | None = None,
    ) -> None:
        self.resource, self.devices, self.shape_allocation = resource, devices, shape_allocation
        self.encoder = encoder or _ListEncoder(resource)
        self.ending = trio.Event() if ending is None else ending
        self.examine, self.examiner, self.config = examine, examiner, config
        self.status = status or StreamStatus()
        self.preferred: _PreferredOrder | None = None  # the current device set's, made after a change
        # One server per resource and registration: the previous one, and the commands it ran, are
        # stopped before the next serves, so these slots are the resource's.
        self.pre_start_slots = trio.CapacityLimiter(PRE_START_CONCURRENCY)

    def now(self) -> ResourceConfig:
        """The resource's configuration as it is now (a reload may have changed it in place)."""
        return self.resource if self.config is None else self.config.value

    def GetDevicePluginOptions(self, empty: Any) -> Any:  # noqa: N802 - the RPC's name
        # The kubelet calls this while it handles our Register, before it answers: the dial-back.
        return device_plugin_options(self.now())

    async def ListAndWatch(self, empty: Any, request: RequestReceived) -> AsyncIterator[Any]:  # noqa: N802
        # The kubelet keeps this one stream open for as long as we are registered: the full list
        # now, then the full list again after every change. Each message replaces the last.
        resource, devices, ending = self.resource, self.devices, self.ending
        counted = PROBE_METADATA not in request.custom_metadata  # a probe's stream is not the kubelet's
        if counted:
            self.status.streams += 1
        try:
            current = devices.value
            sent = None  # what this stream's kubelet was sent last (the serialized list)
            while True:
                message = self.encoder.encode(current, self.now())
                if message.data == sent:
                    # The entries changed but not what the kubelet is told (a member joining a device
                    # of several, a mode, another reason to be unhealthy), or changed and changed
                    # back within one push interval. Each message makes the kubelet rebuild the
                    # resource's device sets and write its checkpoint (genericDeviceUpdateCallback,
                    # kubernetes/kubernetes pkg/kubelet/cm/devicemanager/manager.go): for the same
                    # list, that is work for nothing.
                    _log(resource).debug("the kubelet's list is unchanged: not sent again")
                elif len(message.data) <= KUBELET_MAX_MESSAGE:
                    yield message
                    sent = message.data
                    _log(resource).debug("sent %s", _devices(len(current)))
                    if _metrics is not None:
                        _metrics.list_sends.labels(resource.name).inc()
                else:
                    # The kubelet would drop the message and its stream (then every device turns
                    # unhealthy): keep its last list instead, and say what to do.
                    _log(resource).error(
                        "%d devices make a %.1f MiB ListAndWatch message, over the kubelet's limit of %d MiB: "
                        "not sent, the kubelet keeps the previous list; split the devices over several resources "
                        "(pattern) or use fewer replicas",
                        len(current),
                        len(message.data) / 2**20,
                        KUBELET_MAX_MESSAGE // 2**20,
                    )
                if current is RETIRED:
                    return
                # A burst (a driver creating thousands of device nodes) becomes a few messages, each
                # with the latest list; a change after a quiet moment still goes out at once.
                await trio.sleep(LIST_PUSH_INTERVAL)
                while devices.value is current and not ending.is_set():
                    await devices.wait_touched()
                if ending.is_set():
                    return  # the kubelet sees the stream end, and forgets this registration
                current = devices.value
        except Exception:
            # It ends this stream only (its refusal is the call's status, _held_back). The kubelet
            # forgets the registration with the stream (runClient, below): registered anew, it opens
            # another one, which starts from the devices as they are.
            self.status.stream_failed = counted
            devices.touch()
            raise
        finally:
            if counted:
                self.status.stream_ended()

    def GetPreferredAllocation(self, request: Any) -> Any:  # noqa: N802
        # When a pod asks for devices, before Allocate, if our options said we answer it.
        resource, known = self.now(), self.devices.value
        preferred = self.preferred
        if preferred is None or preferred.resource is not resource or preferred.devices is not known:
            # A device set is replaced, never changed in place: the order is made once per set.
            preferred = self.preferred = _PreferredOrder(resource, known)
        return preferred_allocation_response(resource, known, request, order=preferred)

    def Allocate(self, request: Any) -> Any:  # noqa: N802
        # Once per container the kubelet admits, which waits for the answer: it has a deadline of ours (_found_now).
        # Immediate (_ImmediateService) unless shape_allocation or an examination that may hang (examiner) waits.
        if self.shape_allocation is not None or (check := self._check()) is None:
            return functools.partial(self._allocate_and_shape, request)
        with _timed(lambda metrics: metrics.allocate.labels(self.resource.name)), self._refusals(request) as ids:
            response, _ = allocate_with_devices(self.now(), self._devices_now(ids, check), request)
            for container in request.container_requests:
                _log(self.resource).info("allocated %s", _named(list(container.devices_ids)))
            return response

    async def _allocate_and_shape(self, request: Any) -> Any:
        # Allocate, then the embedding program's shape_allocation on each container's answer.
        with _timed(lambda metrics: metrics.allocate.labels(self.resource.name)), self._refusals(request) as ids:
            response, allocated = allocate_with_devices(self.now(), await self._found_now(ids), request)
            for container, chosen, answer in zip(
                request.container_requests, allocated, response.container_responses, strict=True
            ):
                shaped = self.shape_allocation(chosen, answer) if self.shape_allocation is not None else None
                if inspect.isawaitable(shaped):
                    await shaped
                _log(self.resource).info("allocated %s", _named(list(container.devices_ids)))
            return response

    async def PreStartContainer(self, request: Any) -> Any:  # noqa: N802
        # The kubelet calls this only if GetDevicePluginOptions said pre_start_required.
        with _timed(lambda metrics: metrics.pre_start.labels(self.resource.name)):
            if (current := self.now()).pre_start:
                chosen = allocated_devices(current, await self._found_now(request.devices_ids), request.devices_ids)
                await run_pre_start(current, chosen, self.pre_start_slots)
            return v1beta1.PreStartContainerResponse()

    @contextlib.contextmanager
    def _refusals(self, request: Any) -> Iterator[list[str]]:
        ids = [kubelet_id for container in request.container_requests for kubelet_id in container.devices_ids]
        try:
            yield ids
        except RPCError as error:
            # The kubelet fails the pod (UnexpectedAdmissionError, with this message in its events):
            # the plugin's log says so too, once per refusal.
            _log(self.resource).warning("refused Allocate of %s: %s", _named(ids) or "no device", error.message)
            raise

    def _check(self, off_loop: bool = False) -> Callable[[DeviceEntry], DeviceEntry | str | None] | None:
        return self.examiner(off_loop) if self.examiner is not None else self.examine or (lambda device: device)

    async def _found_now(self, ids: Iterable[str]) -> Mapping[str, DeviceEntry]:
        """_devices_now, in a thread (_SCANNERS') if it may hang (_check), refused past FILE_READ_TIMEOUT: a lookup
        under a dead NFS or hung FUSE mount never returns, and on the loop would freeze all RPCs, /healthz, SIGTERM."""
        if (check := self._check()) is not None:
            return self._devices_now(ids, check)
        with trio.move_on_after(FILE_READ_TIMEOUT):
            return await trio.to_thread.run_sync(
                self._devices_now, ids, abandon_on_cancel=True, limiter=_SCANNERS.get()
            )
        where = ", ".join(source.directory for source in self.now().sources)
        why = f"its files have not answered in {FILE_READ_TIMEOUT:g} s (a hung mount under {where}?)"
        raise RPCError(StatusCode.FAILED_PRECONDITION, f"{self.resource.name} device {_named(list(ids))}: {why}")

    def _devices_now(self, ids: Iterable[str], check: Any = None) -> Mapping[str, DeviceEntry]:
        # An entry's symlink may have been re-pointed a moment ago, its event not handled yet: what
        # the container gets is decided from the file system as it is now (and confined again).
        known: Mapping[str, DeviceEntry] = self.devices.value
        if self.examiner is None and self.examine is None:
            return known  # an embedder's devices, as given: nothing to look at again (nor per ID)
        check = check or self._check(off_loop=True)
        found_now = {}
        current = self.now()
        for device_id in {current.underlying_id(kubelet_id) for kubelet_id in ids}:
            if device_id is not None and device_id in known:
                found = check(known[device_id])
                if isinstance(found, str):
                    raise RPCError(StatusCode.FAILED_PRECONDITION, f"{self.resource.name} device {device_id}: {found}")
                if found is not None:
                    found_now[device_id] = found
        return found_now

    def service(self) -> purerpc.Service:
        """The purerpc service: the methods that never wait are immediate (_ImmediateService)."""
        service = _ImmediateService(f"{API_VERSION}.DevicePlugin")
        immediate: dict[str, Callable[[Any], Any]] = {
            "GetDevicePluginOptions": self.GetDevicePluginOptions,
            "GetPreferredAllocation": self.GetPreferredAllocation,
            "Allocate": self.Allocate,
        }
        waiting: dict[str, Callable[..., Any]] = {
            "ListAndWatch": self.ListAndWatch,
            "PreStartContainer": self.PreStartContainer,
        }
        # GetPreferredAllocation reads its request as _PreferredAllocationWire (its IDs as bytes).
        signatures = {name: METHODS[f"/{API_VERSION}.DevicePlugin/{name}"].signature for name in [*immediate, *waiting]}
        signatures["GetPreferredAllocation"] = _PREFERRED_WIRE_SIGNATURE
        for name, handler in immediate.items():
            service.add_immediate_method(name, handler, signatures[name])
        for name, waits in waiting.items():
            service.add_method(name, waits, signatures[name])
        return service


def device_plugin_service(*args: Any, **kwargs: Any) -> purerpc.Service:
    """The DevicePlugin service for one resource, as a purerpc service (DevicePluginService's arguments)."""
    return DevicePluginService(*args, **kwargs).service()


#: At most this many pre_start commands of a resource run at once; the kubelet's further calls wait
#: (counted in pre_start_timeout). A node starting 110 pods (the kubelet's maximum) must not fork 110
#: hook processes at once, each perhaps resetting hardware; eight let a burst of quick ones through.
PRE_START_CONCURRENCY = 8


async def run_pre_start(resource: ResourceConfig, chosen: list[DeviceEntry], slots: trio.CapacityLimiter) -> None:
    """Run the resource's pre_start command (run_program, stdout /dev/null) for a container about
    to start with ``chosen`` (DRA: a claim's), with the env var of an allocation and GOPHERPLUG_RESOURCE, once one of
    ``slots`` is free (PRE_START_CONCURRENCY). A failure, or waiting and running past
    pre_start_timeout, is an RPCError with its stderr's lines: the kubelet puts it in the pod's events."""
    command = resource.pre_start[0]
    env = {**os.environ, resource.env: ",".join(d.id for d in chosen), "GOPHERPLUG_RESOURCE": resource.name}
    started = False
    try:
        # One deadline for waiting and running: the kubelet's 30 s run from its call, not from
        # when a slot came free.
        with trio.fail_after(resource.pre_start_timeout):
            async with slots:
                started = True
                ran = await run_program(resource.pre_start, env)
    except trio.TooSlowError:
        if not started:
            raise RPCError(
                StatusCode.DEADLINE_EXCEEDED,
                f"pre_start {command} did not start within {resource.pre_start_timeout:g} s: it waited all that "
                f"time for one of the {slots.total_tokens} pre_start commands already running for {resource.name} "
                "to finish",
            ) from None
        raise RPCError(
            StatusCode.DEADLINE_EXCEEDED,
            f"pre_start {command} did not finish within {resource.pre_start_timeout:g} s (killed)",
        ) from None
    except OSError as error:
        raise RPCError(StatusCode.UNKNOWN, f"pre_start: cannot run {command}: {_describe(error)}") from None
    if ran.returncode != 0:
        raise RPCError(StatusCode.UNKNOWN, f"pre_start {command} {ran.how()}{ran.said()}")
    _log(resource).info("pre_start %s done for %s", command, _named([d.id for d in chosen]))


async def register(
    resource: ResourceConfig,
    endpoint: str,
    kubelet: KubeletWatch,
    still_serving: Callable[[], bool],
    devices: Watched | None = None,
) -> int | None:
    """Register ``endpoint`` for ``resource`` with the kubelet, retrying until it succeeds.

    Returns the kubelet generation registered with, or None as soon as ``still_serving()`` turns
    false (a starting kubelet deletes every socket, ours included: serve anew before registering;
    or the resource was removed from the configuration, which ``devices`` changing wakes us for).
    While kubelet.sock is absent, waits for it with inotify; after a failure, retries with a capped
    backoff, at once if a new kubelet.sock appears."""
    wake = (kubelet.changed,) if devices is None else (kubelet.changed, devices)
    request = v1beta1.RegisterRequest(
        version=API_VERSION, endpoint=endpoint, resource_name=resource.name, options=device_plugin_options(resource)
    )
    delay, waiting_logged = _REGISTER_BACKOFF[0], False
    while still_serving():
        generation = kubelet.current()  # just before the call: see there why
        if generation is None:
            if not waiting_logged and not os.path.lexists(kubelet.kubelet_socket):
                _log(resource).info("waiting for the kubelet: no %s yet", kubelet.kubelet_socket)
                waiting_logged = True
            await _any_touched(*wake)
            continue
        try:
            await call_unary(kubelet.kubelet_socket, METHODS[REGISTER], request, timeout=REGISTER_TIMEOUT)
            return generation
        except RPCError as error:
            # Right after kubelet.sock appears, connecting can be refused for a moment: not worth a warning.
            level = logging.DEBUG if error.code == StatusCode.UNAVAILABLE and delay < 0.5 else logging.WARNING
            _log(resource).log(level, "registration failed, retrying in %.2g s: %s", delay, error)
        with trio.move_on_after(delay):
            while kubelet.generation == generation and still_serving():
                await _any_touched(*wake)
        delay = min(delay * 2, _REGISTER_BACKOFF[1])
    return None


PROBE_TIMEOUT = 3.0  # per call; a plugin answers in milliseconds

#: How long `who` keeps asking a kubelet that refuses it past its rate limit (100 calls a second
#: for the whole socket, in bursts of 10: other clients are using it up) before it gives up.
POD_RESOURCES_PATIENCE = 10.0


async def list_pod_resources(socket_path: str, waiting: Callable[[str], None] = log.warning) -> list[Any]:
    """The kubelet's PodResources List: every active pod, with each container's devices and claims.

    The kubelet refuses calls past its rate limit at once with RESOURCE_EXHAUSTED ("rejected by
    rate limit", pkg/kubelet/apis/grpc/ratelimit.go; a token bucket, not a queue): so ask again a
    little later, saying so through ``waiting``, for POD_RESOURCES_PATIENCE seconds at most.
    Raises GopherplugError with one line to act on when the socket cannot be reached.
    """
    method = PODRESOURCES_METHODS[LIST_POD_RESOURCES]
    delay, waited = 0.05, 0.0
    while True:
        try:
            response = await call_unary(
                socket_path, method, podresourcespb.ListPodResourcesRequest(), timeout=PROBE_TIMEOUT
            )
            return list(response.pod_resources)
        except RPCError as error:
            if error.code == StatusCode.RESOURCE_EXHAUSTED and waited < POD_RESOURCES_PATIENCE:
                waiting(f"the kubelet refused PodResources List past its rate limit ({error.message}): asking again")
                await trio.sleep(delay)  # the bucket refills a token every 10 ms
                waited, delay = waited + delay, min(delay * 2, 1.0)
                continue
            if error.code == StatusCode.RESOURCE_EXHAUSTED:
                raise GopherplugError(
                    f"the kubelet's PodResources API at {socket_path} refused every call for {waited:.0f} s past its "
                    "rate limit (100 a second for the whole node): another client is using it up"
                ) from None
            if not os.path.exists(socket_path):
                raise GopherplugError(
                    f"no kubelet PodResources socket at {socket_path}: in a pod, mount the kubelet's "
                    f"{os.path.dirname(socket_path)} read-only at that path (the shipped manifests do); elsewhere, "
                    "give --pod-resources-socket"
                ) from None
            raise GopherplugError(f"the kubelet's PodResources API at {socket_path}: {error.message}") from None


#: While running pods hold devices under other IDs, PodResources is asked again this often: a
#: device held back is offered again at most this long after its pod has ended.
FOREIGN_HOLDS_POLL = 10.0
#: How long serve waits for PodResources' answer before it registers a resource: the kubelet
#: answers in milliseconds; a kubelet that does not is not allowed to hold the registration up.
FOREIGN_HOLDS_PATIENCE = 5.0


async def _pods_holding(resource: ResourceConfig, socket_path: str) -> list[Any] | None:
    """PodResources' pods, or None where it cannot tell (no socket: a plugin embedded without a
    kubelet's; an error or no answer in FOREIGN_HOLDS_PATIENCE, logged at debug: advice only)."""
    if not os.path.exists(socket_path):
        return None
    with trio.move_on_after(FOREIGN_HOLDS_PATIENCE):
        try:
            return await list_pod_resources(socket_path, waiting=_log(resource).debug)
        except GopherplugError as error:
            _log(resource).debug("cannot look for devices held under other IDs: %s", error)
            return None
    _log(resource).debug("cannot look for devices held under other IDs: PodResources did not answer")
    return None


async def hold_back_foreign_holds(
    resource: ResourceConfig,
    devices: Watched,
    socket_path: str,
    *,
    task_status: trio.TaskStatus[Watched] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Before a resource registers: the devices to offer the kubelet, started() with ``devices``
    itself when no running pod holds one of them under another ID (the common case: then this
    returns), else with a Watched that follows ``devices`` with each held device reported
    Unhealthy (held_back) until PodResources, asked every FOREIGN_HOLDS_POLL seconds, shows its
    pod gone. Logs one warning line naming the holds (foreign_holds_report) and a line per device
    offered again.

    A shared resource (replicas) holds nothing back: the other pod has one share of the device,
    and every share the kubelet gives is a share of it too."""
    pods = await _pods_holding(resource, socket_path)
    holds = foreign_holds(resource, devices.value.values(), pods) if pods and isinstance(devices.value, dict) else []
    shared = resource.replicas > 1
    if holds:
        _log(resource).warning("%s", foreign_holds_report(holds, held_back=not shared))
    if not holds or shared:
        task_status.started(devices)
        return
    offered = Watched(held_back(devices.value, holds))
    task_status.started(offered)
    deadline = trio.current_time() + FOREIGN_HOLDS_POLL
    while True:
        touched = devices.next_touch()
        with trio.move_on_at(deadline if holds else math.inf):
            await touched.wait()
        if devices.value is RETIRED:
            offered.replace(RETIRED)
            return
        if holds and trio.current_time() >= deadline:
            pods = await _pods_holding(resource, socket_path)
            if pods is not None:  # when it cannot tell, the devices stay held back
                before = {hold.device_id for hold in holds if hold.device_id}
                holds = foreign_holds(resource, devices.value.values(), pods)
                for device_id in sorted(before - {hold.device_id for hold in holds}):
                    _log(resource).info(
                        "%s: the pod holding it under another plugin's ID has ended: offered", device_id
                    )
            deadline = trio.current_time() + FOREIGN_HOLDS_POLL
        offered.replace(held_back(devices.value, holds))  # every touch passes on, as the streams wait on it


# 6c. The HTTP server: metrics and health --------------------------------------------------------------
class Metrics:
    """Prometheus metrics (prometheus_client, the ``metrics`` extra, imported here: only a plugin
    with ``metrics_address`` needs it), in their own CollectorRegistry so that several plugins (tests,
    an embedding program) each serve their own. The hooks elsewhere are ``if _metrics is not None``:
    with metrics off, Allocate and ListAndWatch pay one global lookup."""

    def __init__(self, address: str) -> None:
        try:
            import prometheus_client as prometheus
        except ImportError as error:
            raise GopherplugError(_METRICS_EXTRA.format(error=error)) from None
        self.registry = registry = prometheus.CollectorRegistry()
        labels = ("resource",)
        counter = functools.partial(prometheus.Counter, registry=registry)
        histogram = functools.partial(prometheus.Histogram, registry=registry)
        # What the kubelet (or the DRA driver's slices) can offer, and why capacity is short.
        self.devices = prometheus.Gauge(
            "gopherplug_devices", "Devices found, by resource and health", ("resource", "health"), registry=registry
        )
        # A registration that keeps repeating means the kubelet keeps dropping us.
        self.registrations = counter("gopherplug_registrations", "Successful registrations with the kubelet", labels)
        # Each restart wipes every plugin socket: with registrations, tells whether we followed.
        self.kubelet_restarts = counter(
            "gopherplug_kubelet_restarts", "Kubelet restarts seen (kubelet.sock created anew)"
        )
        # Each is a full device list to the kubelet: a high rate is a flapping device.
        self.list_sends = counter(
            "gopherplug_list_and_watch_sends", "ListAndWatch device lists sent to the kubelet", labels
        )
        # The calls a pod's start waits for.
        self.allocate = histogram("gopherplug_allocate_seconds", "Allocate latency", labels)
        self.pre_start = histogram(
            "gopherplug_pre_start_container_seconds",
            "PreStartContainer latency (the pre_start command included)",
            labels,
        )
        self.prepare = histogram("gopherplug_node_prepare_resources_seconds", "DRA NodePrepareResources latency")
        # Rescans are the expensive path; overflows mean inotify could not keep up with a burst.
        self.rescans = counter("gopherplug_rescans", "Full rescans of a watched directory")
        self.overflows = counter(
            "gopherplug_inotify_overflows", "Inotify queue overflows (events lost, a rescan follows)"
        )
        # Slices that cannot be written leave the scheduler with a stale view of the node.
        self.api_errors = counter("gopherplug_api_errors", "Failed API server requests, by DRA pool", ("pool",))
        # Each is a bug in gopherplug that an input met, and the input held back (_held_back): report it.
        self.unexpected = counter("gopherplug_unexpected_errors", "Bugs met", ("input",))
        # A task of serve that failed and was started again (_supervised): above 0 is worth a look at the log.
        self.restarts = counter("gopherplug_task_restarts", "Supervised tasks started again after a failure", ("task",))
        # Served by _serve_http, within its limits (prometheus_client's own server: a thread per
        # connection, no timeout). Bound here: a port in use fails the start with one line.
        self._generate_latest = prometheus.generate_latest
        self._content_type = prometheus.CONTENT_TYPE_LATEST
        self._socket, self._address = _http_listener(address, "metrics_address"), address
        self.port: int = self._socket.getsockname()[1]  # the one chosen, for port 0
        self._scope = trio.CancelScope()
        self._serving = False

    def answer(self, request: bytes) -> bytes:
        """The HTTP response to one request: GET /metrics, the registry in Prometheus's text format."""

        def body() -> tuple[int, bytes]:
            return 200, self._generate_latest(self.registry)

        return _http_answer(request, ("/metrics",), body, self._content_type)

    async def serve_http(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Answer GET /metrics until close() (or cancelled), within _serve_http's limits; after a
        failure (_supervised), on the same address bound again."""
        if self._scope.cancel_called:
            return  # closed before it was served (or before it started again): the socket is closed already
        if self._serving:  # started again after a failure: _serve_http closed the socket
            address = f"{self._address.rpartition(':')[0]}:{self.port}"  # the port chosen for port 0 too
            self._scope, self._socket = trio.CancelScope(), _http_listener(address, "metrics_address")
        self._serving = True
        with self._scope:
            await _serve_http(self._socket, self.answer, task_status=task_status)  # closes the socket as it ends

    def set_devices(self, resource: str, devices: Mapping[str, DeviceEntry]) -> None:
        healthy = sum(1 for device in devices.values() if device.health == HEALTHY)
        self.devices.labels(resource, HEALTHY).set(healthy)
        self.devices.labels(resource, UNHEALTHY).set(len(devices) - healthy)

    # A resource's series appear at 0 when it starts and go with it: an alert on a series that is
    # absent never fires, and a removed resource's would go on with its last value.

    def serve(self, resource: ResourceConfig, pool: str | None) -> None:
        """Give a starting resource every series that applies to it, at 0 where it has none yet (a
        resource served anew after a reload keeps its counts); ``pool``: its DRA pool, if the DRA
        driver publishes one for it."""
        for health in (HEALTHY, UNHEALTHY):
            self.devices.labels(resource.name, health)
        if resource.device_plugin:
            for metric in self._device_plugin_series():
                metric.labels(resource.name)
        if pool is not None:
            self.api_errors.labels(pool)

    def forget(self, name: str, pool: str | None, now: ResourceConfig | None) -> None:
        """Remove the series of resource ``name`` that no longer apply after a reload: all of them
        when it is not served any more (``now`` is None), else those of the API it left."""
        gone: list[tuple[Any, tuple[str, ...]]] = []
        if now is None:
            gone += [(self.devices, (name, health)) for health in (HEALTHY, UNHEALTHY)]
        if now is None or not now.device_plugin:
            gone += [(metric, (name,)) for metric in self._device_plugin_series()]
        if pool is not None and (now is None or not now.dra):
            gone.append((self.api_errors, (pool,)))
        for metric, labels in gone:
            with contextlib.suppress(KeyError):  # never made: a resource that failed to start, say
                metric.remove(*labels)

    def _device_plugin_series(self) -> tuple[Any, ...]:
        return (self.registrations, self.list_sends, self.allocate, self.pre_start)

    def close(self) -> None:
        """Stop serving: serve_http() ends and closes the port (or it is closed here, never served)."""
        self._scope.cancel()
        if not self._serving:
            self._socket.close()


def _timed(histogram: Callable[[Metrics], Any]) -> contextlib.AbstractContextManager[Any]:
    """Time the block into ``histogram(_metrics)``, or do nothing while metrics are off."""
    return contextlib.nullcontext() if _metrics is None else histogram(_metrics).time()


# The liveness check the kubelet asks for: `GET /healthz` on health_address, answered by the running
# process from what it knows already (docs/operations.md, "The liveness check", says what each check
# proves): registered with the kubelet that runs now (its generation compared, its socket's inode),
# used (a ListAndWatch stream, as `gopherplug probe` asks), and alive (the answer comes from the event
# loop that answers every gRPC call: a wedged loop answers nothing, and timeoutSeconds fails it). No
# socket is dialed per check: the kubelet's own dial-back and streams prove that already.


class Health:
    """The checks GET /healthz runs: each running part adds one (a callable that returns "" when
    fine, else one line saying what is wrong) for as long as it runs."""

    def __init__(self) -> None:
        self._checks: dict[int, tuple[str, Callable[[], str]]] = {}
        self._next = itertools.count()

    @contextlib.contextmanager
    def check(self, name: str, problem: Callable[[], str]) -> Iterator[None]:
        """Run ``problem`` in every answer while the block runs: "name: problem" when it says one."""
        key = next(self._next)
        self._checks[key] = (name, problem)
        try:
            yield
        finally:
            del self._checks[key]

    def problems(self) -> list[str]:
        """What is wrong now, a line per failing check (none: healthy). A check that raises fails."""
        found = []
        for name, problem in list(self._checks.values()):
            try:
                said = problem()
            except Exception as error:  # a broken check must fail the probe, not the server
                said = f"the check failed: {_describe(error)}"
            if said:
                found.append(f"{name}: {said}")
        return found


#: The Health of the serve_plugin() this task runs under (None: none, no checks). A context variable,
#: not an argument through every layer: trio gives each task a copy of its parent's context, so two
#: plugins in one process (tests, an embedding program) each keep theirs.
_HEALTH: contextvars.ContextVar[Health | None] = contextvars.ContextVar("gopherplug_health", default=None)


def _health_check(name: str, problem: Callable[[], str]) -> contextlib.AbstractContextManager[None]:
    """Health.check on the running plugin's Health, or nothing outside serve_plugin."""
    health = _HEALTH.get()
    return contextlib.nullcontext() if health is None else health.check(name, problem)


# The two HTTP ports, health and metrics, are served by one small HTTP/1.1 server on the event loop,
# with the limits of Go's http.Server with ReadHeaderTimeout and WriteTimeout set (the kubelet's own
# ports): the health port is open to every pod of the cluster, and a peer that holds connections,
# trickles bytes or does not read must keep neither the probe out nor a task. One request per
# connection (Connection: close), as the kubelet's prober and Prometheus make them: the header
# timeout is also the idle timeout.

#: The most connections one HTTP port serves at once; a new one past it closes the oldest: held open,
#: they push each other out, never the kubelet's probe, which sends its request as it connects. 64
#: is room for the kubelet's probe, several scrapers and a person with curl.
HTTP_MAX_CONNECTIONS = 64
#: How long a connection may take to send its whole request head, counted from its accept (Go's
#: ReadHeaderTimeout, not reset by each byte: a slowloris gets this, not forever). The kubelet's
#: prober writes its request at once and gives up after timeoutSeconds (1 s by default).
HTTP_HEADER_TIMEOUT = 2.0
#: How long writing an answer may take (Go's WriteTimeout): a peer that does not read gets closed.
HTTP_WRITE_TIMEOUT = 5.0
#: The most of a request read: the kubelet's is about 150 bytes, Prometheus's about 300; nothing
#: here reads more than the request line.
HTTP_MAX_REQUEST = 8192
#: The paths answered: /healthz as the kubelet's own and most plugins' (the manifests' httpGet),
#: /livez as the API server names the same check.
HEALTH_PATHS = ("/healthz", "/livez")


def _http_answer(
    request: bytes, paths: tuple[str, ...], body: Callable[[], tuple[int, bytes]], content_type: str
) -> bytes:
    """The HTTP/1.1 response to one request: ``body()`` (its code and bytes) for GET or HEAD of one
    of ``paths``; 404 for another path, 405 for another method, 400 for what is not a request line,
    500 for a bug (_held_back)."""
    line = request.split(b"\r\n", 1)[0]
    parts, code, data, kind = line.split(), 500, b"", "text/plain; charset=utf-8"
    with _held_back("http", f"HTTP request {line[:80]!r}"):
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            code, data = 400, b"not an HTTP request\n"
        elif parts[0] not in (b"GET", b"HEAD"):
            code, data = 405, b"only GET and HEAD\n"
        elif _request_path(parts[1]) not in paths:
            code, data = 404, f"not found: ask {paths[0]}\n".encode()
        else:
            (code, data), kind = body(), content_type
    head = (
        f"HTTP/1.1 {code} {http.HTTPStatus(code).phrase}\r\nContent-Type: {kind}\r\n"
        f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + (b"" if parts[:1] == [b"HEAD"] else data)


def _request_path(target: bytes) -> str:
    """A request target's path: "/healthz" of "/healthz?verbose" and of the absolute form
    "http://host/healthz", which RFC 9112 (section 3.2.2) says a server must accept."""
    target = target.split(b"?", 1)[0]
    if b"://" in target:
        target = b"/" + (target.split(b"/", 3)[3:] or [b""])[0]
    return target.decode("latin-1")


def health_answer(health: Health, request: bytes) -> bytes:
    """The HTTP/1.1 response to one request: 200 "ok", 503 with a line per problem, 404 for another
    path, 405 for a method other than GET and HEAD, 400 for what is not an HTTP request line."""

    def body() -> tuple[int, bytes]:
        problems = health.problems()
        return (503, "".join(f"{line}\n" for line in problems).encode()) if problems else (200, b"ok\n")

    return _http_answer(request, HEALTH_PATHS, body, "text/plain; charset=utf-8")


def _http_listener(address: str, what: str) -> socket.socket:
    """A listening TCP socket on ``address`` ("host:port", "[::]:port"), non-blocking;
    GopherplugError naming ``what`` (the configuration key) if it cannot be had."""
    host, _, port = address.rpartition(":")
    try:
        family, kind, protocol, _, where = socket.getaddrinfo(
            host.strip("[]"), int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        listener = socket.socket(family, kind, protocol)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as trio's listeners
            listener.bind(where)
            listener.listen(socket.SOMAXCONN)
            listener.setblocking(False)
        except OSError:
            listener.close()
            raise
    except OSError as error:
        raise GopherplugError(f"{what} {address}: cannot serve: {_describe(error)}") from None
    return listener


async def _serve_http(
    listener: socket.socket,
    answer: Callable[[bytes], bytes],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Answer one request per connection with ``answer(request head)`` until cancelled, within
    HTTP_MAX_CONNECTIONS, HTTP_HEADER_TIMEOUT, HTTP_MAX_REQUEST and HTTP_WRITE_TIMEOUT; closes
    ``listener`` (a _http_listener()) on the way out. Connections are accepted as many at a time as
    are waiting (trio's serve_listeners takes one per pass of its scheduler): the kubelet's probe
    behind a thousand in the backlog is reached in one pass."""
    open_now: dict[trio.CancelScope, None] = {}  # each connection's scope, oldest first

    def complete(request: bytes) -> bool:
        return b"\r\n\r\n" in request or len(request) >= HTTP_MAX_REQUEST

    def answer_at_once(connection: socket.socket) -> tuple[bytes, bytes]:
        """Answer a request that is there already (the kubelet's probe writes it as it connects) in
        the accepting task, with no pass of the scheduler in between. Returns what is left to do:
        the request read so far, if incomplete, and the answer's bytes that did not fit the socket."""
        try:
            request = connection.recv(HTTP_MAX_REQUEST)
        except BlockingIOError:
            return b"", b""
        if not complete(request):
            return request, b""
        data = answer(request)
        try:
            sent = connection.send(data)
        except BlockingIOError:
            sent = 0
        return request, data[sent:]

    async def serve_one(connection: socket.socket, request: bytes, unsent: bytes) -> None:
        stream = trio.SocketStream(trio.socket.from_stdlib_socket(connection))
        scope = trio.CancelScope()
        open_now[scope] = None
        if len(open_now) > HTTP_MAX_CONNECTIONS:
            oldest = next(iter(open_now))
            del open_now[oldest]
            oldest.cancel()
        try:
            with scope:
                with trio.move_on_after(HTTP_HEADER_TIMEOUT):
                    while not complete(request):
                        chunk = await stream.receive_some(4096)
                        if not chunk:
                            break
                        request += chunk
                if complete(request):
                    with trio.move_on_after(HTTP_WRITE_TIMEOUT):
                        await stream.send_all(unsent or answer(request))
        except Exception as error:  # a client gone mid-answer: its loss, not the server's
            log.debug("HTTP request: %s", _describe(error))
        finally:
            open_now.pop(scope, None)
            with trio.move_on_after(1):  # aclose() of a TCP stream does not block; the bound is for form
                await stream.aclose()

    short_of = ""
    try:
        async with trio.open_nursery() as nursery:
            task_status.started()
            while True:
                await trio.lowlevel.wait_readable(listener)
                while True:
                    try:
                        connection, _ = listener.accept()
                    except BlockingIOError:
                        break
                    except OSError as error:
                        if error.errno not in _ACCEPT_CAPACITY_ERRORS:
                            raise
                        if not short_of:  # as _accept() says it for the plugin's sockets
                            short_of = os.strerror(error.errno or 0)
                            log.error("cannot accept HTTP connections: %s; retrying", short_of)
                        await trio.sleep(ACCEPT_RETRY_INTERVAL)
                        break
                    short_of = ""
                    connection.setblocking(False)
                    try:
                        request, unsent = answer_at_once(connection)
                    except OSError as error:  # reset by the peer already
                        log.debug("HTTP request: %s", _describe(error))
                        request, unsent = b"\r\n\r\n", b""
                    if complete(request) and not unsent:
                        connection.close()  # answered
                    else:
                        nursery.start_soon(serve_one, connection, request, unsent)
    finally:
        trio.lowlevel.notify_closing(listener)
        listener.close()


async def serve_health(
    address: str, health: Health, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
) -> None:
    """Answer GET /healthz on ``address`` ("host:port") until cancelled; started() with the port
    (the one chosen, for port 0). One request per connection, as the kubelet's prober makes them
    (it disables keep-alive), within the limits of _serve_http."""
    host = address.rpartition(":")[0]
    listener = _http_listener(address, "health_address")
    chosen = listener.getsockname()[1]
    log.info("serving the liveness check on http://%s:%d%s", host, chosen, HEALTH_PATHS[0])
    async with trio.open_nursery() as nursery:
        await nursery.start(_serve_http, listener, functools.partial(health_answer, health))
        task_status.started(chosen)


# 6d. DRA, the node side: three sockets' worth of protocol and one HTTP client -------------------------
#
#   <kubelet root>/plugins_registry/<driver>-reg.sock   Registration: GetInfo, NotifyRegistrationStatus
#   <kubelet root>/plugins/<driver>/dra.sock            DRAPlugin v1 and v1beta1: prepare, unprepare
#   the API server                                      ResourceSlices written, ResourceClaims read
#
# The kubelet's plugin watcher finds the registration socket by inotify on plugins_registry and, when
# it starts, by walking that directory: unlike the device-plugin directory, nothing wipes it, so a
# kubelet restart needs nothing of the plugin but its socket still being there. A socket deleted from
# under us is served again; the watcher sees it created and registers it anew.


#: The deadline of each API server request. The kubelet gives NodePrepareResources 45 s
#: (PluginClientTimeout in kubernetes/kubernetes pkg/kubelet/cm/dra/plugin): a claim the API server
#: is slow to return gets its error well before, and the kubelet asks again.
API_REQUEST_TIMEOUT = 10.0

# After a failed write of a pool (or of a stale slice): retry after 0.1 s, doubling up to 10 s, each
# wait jittered. Writes are per pool and rare; lists and watches back off longer (DRA_WATCH_BACKOFF).
_API_BACKOFF = (0.1, 10.0)

#: How far a wait is spread at random: from d to d * (1 + DRA_JITTER) seconds, as client-go's
#: wait.Jitter (the reflector's backoff uses 1.0). Drivers on 5,000 nodes that saw the same API
#: server restart would otherwise retry, and list, in step.
DRA_JITTER = 1.0

#: After a failed list or watch: retry after 0.8 s, doubling up to 30 s, jittered, and the first wait
#: again once a watch brings something: the reflector's own backoff (client-go tools/cache/reflector.go).
DRA_WATCH_BACKOFF = (0.8, 30.0)

#: How long an open watch may bring nothing, not even a bookmark, before it is taken for a dead
#: connection (no FIN ever comes from a cut network) and opened again from the last version seen.
#: The API server's watch cache sends a bookmark about every minute (nextBookmarkTime in
#: kubernetes/kubernetes staging/src/k8s.io/apiserver/pkg/storage/cacher/cache_watcher.go): three
#: missed ones are not a quiet cluster.
DRA_WATCH_QUIET_SECONDS = 180.0

#: How often the Node is read (GET) when it cannot be watched: an older manifest's ClusterRole has
#: get on nodes but not list and watch. Jittered; a change of its allocatable is then seen that late.
DRA_NODE_POLL_SECONDS = 60.0

#: While the Node is read instead of watched (403), the watch is tried again after this long, at
#: first and at most (doubling, jittered): a ClusterRole fixed later is noticed within minutes.
DRA_NODE_WATCH_RETRY = (60.0, 600.0)


def jittered(seconds: float, factor: float = DRA_JITTER) -> float:
    """``seconds`` spread at random to between itself and (1 + ``factor``) times itself, as client-go's
    wait.Jitter: waits that began together end apart."""
    return seconds * (1.0 + factor * random.random())


#: Go's names of the machine architectures Python's os.uname() calls otherwise (runtime.GOARCH).
_GO_ARCH = {"x86_64": "amd64", "aarch64": "arm64", "i686": "386", "i386": "386", "armv7l": "arm", "armv6l": "arm"}


def user_agent(node_name: str = "") -> str:
    """What gopherplug calls itself in each request to the API server, in client-go's form
    (DefaultKubernetesUserAgent in client-go rest/config.go) with the node in place of the commit:
    the API server's audit log and per-client metrics then tell gopherplug's requests, and one
    node's from another's."""
    machine = os.uname().machine
    agent = f"gopherplug/{__version__} ({sys.platform}/{_GO_ARCH.get(machine, machine)})"
    return f"{agent} node/{node_name}" if node_name else agent


#: Slice writes (create, update, delete) per second at most, after a burst of DRA_WRITE_BURST. A
#: write that succeeds can still be undone at once (another writer, an admission webhook) and be
#: needed again: unbounded, the publisher writes as fast as the API server answers. The Go
#: controller's work queue has client-go's default bucket too: 10 a second, bursts of 100.
DRA_WRITES_PER_SECOND = 10.0
DRA_WRITE_BURST = 100


class _TokenBucket:
    """At most ``rate`` acquisitions a second on average, ``burst`` at once; on trio's clock."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate, self.burst = rate, burst
        self._tokens = float(burst)
        self._last: float | None = None

    async def acquire(self) -> None:
        now = trio.current_time()
        if self._last is not None:
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
        self._last = now
        self._tokens -= 1
        if self._tokens < 0:  # the debt is paid by waiting, so concurrent callers queue up fairly
            await trio.sleep(-self._tokens / self.rate)


def write_device_metadata(path: str, text: str) -> None:
    """Write one metadata file whole (_replace_whole), so a container never reads half of one. Mode
    0644 and directories 0755, the Go helper's: the container may run as any user, and the mount
    is read-only. Raises OSError."""
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    _replace_whole(path, text, ".metadata-", 0o644)


def _ensure_device_metadata(path: str, text: str) -> None:
    """Write a metadata file again unless it is there with ``text``. Raises GopherplugError."""
    try:
        with open(path, encoding="utf-8") as file:
            if file.read() == text:
                return
    except (OSError, ValueError):
        pass  # gone or unreadable: written again
    try:
        write_device_metadata(path, text)
    except OSError as error:
        raise GopherplugError(f"cannot write the device metadata {path}: {_describe(error)}") from None


def remove_claim_metadata(metadata_dir: str, namespace: str, name: str, uid: str) -> None:
    """Remove a claim's metadata files, if any. Raises GopherplugError naming what could not go."""
    directory = dra_claim_metadata_dir(metadata_dir, namespace, name, uid)
    try:
        shutil.rmtree(directory)
    except FileNotFoundError:
        pass
    except OSError as error:
        raise GopherplugError(f"cannot remove the device metadata {directory}: {_describe(error)}") from None


class ClaimCheckpoint:
    """The claims prepared on this node and what each was answered, in a JSON file.

    The kubelet may call NodeUnprepareResources after this plugin restarted, and
    NodePrepareResources again for a claim prepared before: both are answered from here. Written
    whole to a temporary file, flushed, then renamed over the old one: a crash leaves the old file
    or the new one. Raises GopherplugError when the file is there but cannot be read: starting
    without it would overwrite the claims in it.

    The two pods of a rolling update share the file, and a claim one prepared may be unprepared by
    the other (the Go helper's RollingUpdate). So each change is a transaction across processes:
    under the flock on ``lock_path``, the file read again if the other wrote it, changed, written."""

    VERSION = 1

    def __init__(self, path: str, lock_path: str | None = None) -> None:
        self.path = path
        self.lock_path = lock_path or os.path.join(os.path.dirname(path), "serialize.lock")
        # claim UID -> {"namespace", "name", "devices", and "cdi_specs" for a claim with shares}
        self.claims: dict[str, dict[str, Any]] = {}
        self._read_as: tuple[int, int, int, int] | None = None  # the file last read (or written): which, and when
        self._saving = trio.Lock()
        self._read()

    def _read(self) -> None:
        """Read the file again if it is not the one last read or written (another pod replaced it).
        A stat() when nothing changed: cheap enough for every call of the kubelet. Whole files only:
        every writer renames a complete file into place."""
        try:
            status = os.stat(self.path)
            identity = (status.st_dev, status.st_ino, status.st_mtime_ns, status.st_size)
            if identity == self._read_as:
                return
            with open(self.path, "rb") as file:
                text = file.read()
        except FileNotFoundError:
            self.claims, self._read_as = {}, None  # the first start on this node
            return
        except OSError as error:
            raise GopherplugError(
                f"cannot read the checkpoint {self.path}: {_describe(error)}: it holds the claims prepared on this "
                "node; make it readable, or move it away to start without them"
            ) from None
        try:
            data = json.loads(text)
            if data.get("version") != self.VERSION or not isinstance(data.get("claims"), dict):
                raise ValueError(f"not a version {self.VERSION} checkpoint")
            self.claims, self._read_as = data["claims"], identity  # a new dict: never changed in place
        except (ValueError, AttributeError) as error:  # UnicodeDecodeError is a ValueError
            # Kept for a person to look at, not overwritten: the claims in it cannot be unprepared by us.
            aside = f"{self.path}.unreadable"
            os.replace(self.path, aside)
            log.error("%s is unreadable (%s): moved to %s; starting with no prepared claims", self.path, error, aside)
            self.claims, self._read_as = {}, None

    def cdi_specs(self, uid: str) -> list[tuple[ClaimCDISpec, dict[str, Any]]]:
        """The claim's own CDI specs, as add() was given them, by this pod or the other of a rolling update."""
        self._read()
        return [
            (ClaimCDISpec(stored["kind"], stored["spec_dir"], uid), stored["spec"])
            for stored in (self.claims.get(uid) or {}).get("cdi_specs", [])
        ]

    def answer(self, uid: str) -> list[Any] | None:
        """The devices a claim was prepared with (by this pod or the other of a rolling update), or
        None if it was not."""
        self._read()
        if (claim := self.claims.get(uid)) is None:
            return None
        # Earlier versions stored a subrequest's result as "<request>/<subrequest>"; a claim they
        # prepared is answered as the kubelet can match it (dra_base_request), the file left as it is.
        return [
            drapb.Device(**{**device, "request_names": [dra_base_request(r) for r in device["request_names"]]})
            for device in claim["devices"]
        ]

    def metadata_files(self, uid: str) -> list[tuple[str, str]]:
        """The claim's device metadata files as add() wrote them: (host path, text) each."""
        self._read()
        return [(stored["path"], stored["text"]) for stored in (self.claims.get(uid) or {}).get("metadata_files", [])]

    async def add(
        self,
        claim: Any,
        devices: list[Any],
        cdi_specs: Iterable[tuple[CDIConfig, Any]] = (),
        metadata: Iterable[DeviceMetadataFile] = (),
    ) -> list[Any]:
        """Remember a prepared claim, on disk when this returns; the devices to answer: ``devices``,
        or those the other pod of a rolling update answered if it prepared the claim meanwhile.
        Raises GopherplugError, and remembers nothing, when the file cannot be written.
        ``cdi_specs``: the claim's own CDI specs (claim_cdi_specs), kept whole, so that an unprepare
        after a restart removes them, and a prepare after a reboot (/var/run/cdi is a tmpfs) writes
        them again. ``metadata``: its device metadata files, written here under the flock with the
        entry that names them (remove_stale_metadata in the other pod sees both or neither)."""
        metadata = list(metadata)
        fields = ("request_names", "pool_name", "device_name", "cdi_device_ids")
        listed = []
        for device in devices:
            entry = {field: _plain(getattr(device, field)) for field in fields}
            if device.HasField("share_id"):
                entry["share_id"] = device.share_id
            listed.append(entry)
        entry = {"namespace": claim.namespace, "name": claim.name, "devices": listed}
        if specs := [{"kind": cdi.kind, "spec_dir": cdi.spec_dir, "spec": spec} for cdi, spec in cdi_specs]:
            entry["cdi_specs"] = specs
        if metadata:
            entry["metadata_files"] = [{"path": each.host_path, "text": each.text} for each in metadata]

        def change(claims: dict[str, dict[str, Any]]) -> bool:
            if claim.uid in claims:
                return False  # the other pod's files and answer stand
            for each in metadata:
                try:
                    write_device_metadata(each.host_path, each.text)
                except OSError as error:
                    raise GopherplugError(
                        f"cannot write the device metadata {each.host_path}: {_describe(error)}"
                    ) from None
            claims[claim.uid] = entry
            return True

        await self._change(change)
        return self.answer(claim.uid) or devices

    async def remove_stale_metadata(self, metadata_dir: str) -> list[str]:
        """Remove the claims' metadata directories in ``metadata_dir`` that no claim in the file
        names (dra_claim_metadata_dir), under the flock, where add() writes them: a claim the other
        pod is preparing is never taken for a stale one. The directories removed."""

        def sweep(claims: dict[str, dict[str, Any]]) -> bool:
            current = {
                os.path.basename(dra_claim_metadata_dir(metadata_dir, entry["namespace"], entry["name"], uid))
                for uid, entry in claims.items()
            }
            for name in _listing(metadata_dir):
                if name not in current:
                    path = os.path.join(metadata_dir, name)
                    try:
                        shutil.rmtree(path)
                    except OSError as error:
                        log.warning("cannot remove the stale device metadata %s: %s", path, _describe(error))
                    else:
                        removed.append(path)
            return False  # the checkpoint itself is not changed

        removed: list[str] = []
        await self._change(sweep)
        return removed

    async def remove(self, uid: str) -> bool:
        """Forget a claim, on disk when this returns; whether it was known. Raises GopherplugError,
        and keeps the claim, when the file cannot be written."""
        return await self._change(lambda claims: claims.pop(uid, None) is not None)

    async def _change(self, change: Callable[[dict[str, dict[str, Any]]], bool]) -> bool:
        """Apply ``change`` (True: it changed something) to the claims as the file holds them now, and
        write them if it did; whether it did. In a worker thread: a slow disk, or the other pod's
        write, must not stall every socket this process serves."""
        async with self._saving:
            return await trio.to_thread.run_sync(self._change_locked, change)

    def _change_locked(self, change: Callable[[dict[str, dict[str, Any]]], bool]) -> bool:
        directory = os.path.dirname(self.path)
        try:
            os.makedirs(directory, mode=0o750, exist_ok=True)
            lock = os.open(self.lock_path, _LOCK_FLAGS, 0o600)
        except OSError as error:
            raise GopherplugError(f"cannot take the lock {self.lock_path}: {_describe(error)}") from None
        try:
            # Blocks while the other pod holds it: for one write of this file. The file stays: an
            # flock on a file that is removed and made again would let two holders in at once.
            fcntl.flock(lock, fcntl.LOCK_EX)
            self._read()
            claims = dict(self.claims)
            if not change(claims):
                return False
            # One compact line: the json module's C encoder writes that, while an indented file goes
            # through its Python one, several times slower for every claim saved.
            self._write(json.dumps({"version": self.VERSION, "claims": claims}, sort_keys=True))
            self.claims = claims
            return True
        except GopherplugError:
            self._read_as = None  # whatever reached the file is read again next time
            raise
        finally:
            os.close(lock)  # the flock goes with it

    def _write(self, text: str) -> None:
        directory = os.path.dirname(self.path)
        try:
            status = _replace_whole(self.path, text, ".checkpoint-")
            self._read_as = (status.st_dev, status.st_ino, status.st_mtime_ns, status.st_size)
            directory_fd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(directory_fd)  # the rename itself reaches the disk
            finally:
                os.close(directory_fd)
        except OSError as error:
            raise GopherplugError(f"cannot write the checkpoint {self.path}: {_describe(error)}") from None


def _plain(value: Any) -> Any:
    """A protobuf field's value as JSON takes it (repeated fields are not lists)."""
    return value if isinstance(value, str) else list(value)


@dataclass
class DraResources:
    """The resources a DRA driver offers right now: name -> (its configuration, its devices).
    serve_plugin keeps it current across reloads, touching ``changed`` when a resource comes or goes."""

    driver: str
    node_name: str
    served: dict[str, tuple[ResourceConfig, Watched]] = dataclasses.field(default_factory=dict)
    changed: Watched = dataclasses.field(default_factory=lambda: Watched(None))
    unhealthy_taint: str = "NoSchedule"  #: the effect of an unhealthy device's taint (DraConfig)
    #: whose turn it is to write the resources' CDI specs (this pod's or a newer one's): serve_dra takes it
    cdi_turn: CDISpecTurn = dataclasses.field(default_factory=CDISpecTurn)

    def attach(self, resource: ResourceConfig, devices: Watched) -> None:
        self.served[resource.name] = (resource, devices)
        self.changed.touch()

    def detach(self, name: str) -> None:
        if self.served.pop(name, None) is not None:
            self.changed.touch()

    def pools(self) -> dict[str, tuple[ResourceConfig, Mapping[str, DeviceEntry]]]:
        """Pool name -> the resource and its devices now (none while a resource is being removed)."""
        return {
            dra_pool_name(self.node_name, resource.name): (resource, devices.value)
            for resource, devices in self.served.values()
            if devices.value is not RETIRED
        }

    async def wait_changed(self) -> None:
        """Return when a resource comes or goes, or a resource's devices change."""
        await _any_touched(self.changed, *(devices for _, devices in self.served.values()))


#: How long the kubelet may be quiet before a registered driver counts as dropped: three of the
#: plugin watcher's 10 s GetInfo calls missed, and a health stream not opened again.
DRA_KUBELET_SILENCE = 30.0


@dataclass
class RegistrationState:
    """What the kubelet last said in NotifyRegistrationStatus, and its health streams open now
    (for logs and `gopherplug probe`)."""

    registered: bool = False
    error: str = ""
    notified: Watched = dataclasses.field(default_factory=lambda: Watched(0))  #: counts the notifications
    health_streams: int = 0
    serving_since: float = dataclasses.field(default_factory=time.monotonic)
    # Since the last notification: the kubelet's GetInfo calls (not a probe's) and the last one's
    # time; whether a kubelet health stream was opened, and when the last one ended.
    info_calls: int = 0
    last_info: float = 0.0
    health_opened: bool = False
    health_ended: float = 0.0

    def notify(self, registered: bool, error: str) -> None:
        self.registered, self.error = registered, error
        self.info_calls, self.health_opened = 0, False
        self.notified.set(self.notified.value + 1)

    def dropped(self, now: float) -> tuple[str, float]:
        """Why the kubelet seems to have dropped the driver it registered, and since when ("" if it
        does not). The kubelet says nothing when it drops a plugin, but it stops what it did: the
        newest plugin watcher calls GetInfo every 10 s while a plugin is registered (older ones only
        to register: one call after the notification shows this one asks again), and a kubelet
        with ResourceHealthStatus keeps a health stream open. Either quiet for DRA_KUBELET_SILENCE."""
        if not self.registered:
            return "", 0.0
        if self.info_calls and now - self.last_info > DRA_KUBELET_SILENCE:
            return f"it has not called GetInfo for {now - self.last_info:.0f} s", self.last_info
        if self.health_opened and not self.health_streams and now - self.health_ended > DRA_KUBELET_SILENCE:
            return f"its health stream ended {now - self.health_ended:.0f} s ago", self.health_ended
        return "", 0.0

    def message(self, driver: str) -> Any:
        now = time.monotonic()
        dropped, since = self.dropped(now)
        registered = self.registered and not dropped
        return ResourceStatus(
            resource_name=driver,
            registered=registered,
            registration_error=self.error,
            streams=self.health_streams,
            unregistered_seconds=0.0 if registered else now - (since or self.serving_since),
            dropped=dropped,
        )


def registration_service(config: DraConfig, state: RegistrationState) -> purerpc.Service:
    """pluginregistration.Registration: who we are, and where DRAPlugin is served."""

    async def get_info(info: Any, request: RequestReceived) -> Any:
        if PROBE_METADATA not in request.custom_metadata:  # a probe's call is not the kubelet's
            state.info_calls += state.registered
            state.last_info = time.monotonic()
        return pluginregistration.PluginInfo(
            type=DRA_PLUGIN_TYPE,
            name=config.driver,
            endpoint=config.endpoint,
            # DRAPlugin v1 first: the kubelet speaks the first one listed that it knows. Then
            # DRAResourceHealth, newest first; a kubelet ignores the names it does not know.
            supported_versions=[*(v for v, _ in DRA_VERSIONS), *(v for v, _ in DRA_HEALTH_VERSIONS)],
        )

    async def notify_registration_status(status: Any) -> Any:
        if status.plugin_registered:
            log.info("the kubelet registered DRA driver %s", config.driver)
        else:
            log.error("the kubelet refused DRA driver %s: %s", config.driver, status.error)
        state.notify(status.plugin_registered, status.error)
        return pluginregistration.RegistrationStatusResponse()

    service = purerpc.Service(f"{_REGISTRATION_PACKAGE}.Registration")
    for name, handler in (("GetInfo", get_info), ("NotifyRegistrationStatus", notify_registration_status)):
        service.add_method(name, handler, DRA_METHODS[f"/{_REGISTRATION_PACKAGE}.Registration/{name}"].signature)
    return service


def dra_plugin_services(
    resources: DraResources, claims: ClaimPreparer, registration: RegistrationState
) -> list[purerpc.Service]:
    """DRAPlugin in every version the kubelet may speak (the same handlers), DRAResourceHealth, and
    gopherplug's status for `gopherplug probe`, all on the one socket the kubelet dials."""
    services = []
    for _, package in DRA_VERSIONS:
        service = purerpc.Service(f"{package}.DRAPlugin")
        for name, handler in (("NodePrepareResources", claims.prepare), ("NodeUnprepareResources", claims.unprepare)):
            service.add_method(name, handler, DRA_METHODS[f"/{package}.DRAPlugin/{name}"].signature)
        services.append(service)
    status = status_service(functools.partial(registration.message, resources.driver))
    return [*services, *dra_health_services(resources, registration), status]


#: How often NodeWatchResources sends every device again when nothing changed: the kubelet takes a
#: report as valid for DRA_HEALTH_TIMEOUT from when it received it, so a third of that leaves room
#: for two lost or late ones. (This is the protocol's keep-alive; the devices are not polled.)
DRA_HEALTH_RESEND = DRA_HEALTH_TIMEOUT / 3


def dra_health_services(resources: DraResources, registration: RegistrationState) -> list[purerpc.Service]:
    """DRAResourceHealth in every version of DRA_HEALTH_VERSIONS: the health of every device, from
    the same watches as the slices. ``registration`` counts the kubelet's streams (not a probe's)."""

    async def node_watch_resources(empty: Any, request: RequestReceived) -> AsyncIterator[Any]:
        counted = PROBE_METADATA not in request.custom_metadata  # a probe's stream is not the kubelet's
        registration.health_streams += counted
        registration.health_opened |= counted
        try:
            while True:
                yield dra_health_response(resources.pools(), time.time())
                with trio.move_on_after(DRA_HEALTH_RESEND):
                    await resources.wait_changed()
                    # A burst of changes (a driver making many device nodes) becomes a few reports.
                    await trio.sleep(LIST_PUSH_INTERVAL)
        finally:
            registration.health_streams -= counted
            if counted:
                registration.health_ended = time.monotonic()

    services = []
    for version, _ in DRA_HEALTH_VERSIONS:  # the same stream under each version's name
        service = purerpc.Service(version)
        path = f"/{version}/NodeWatchResources"
        service.add_method("NodeWatchResources", node_watch_resources, DRA_METHODS[path].signature)
        services.append(service)
    return services


class ClaimPreparer:
    """NodePrepareResources and NodeUnprepareResources, against the API server and the checkpoint.

    Each claim is prepared on its own. The kubelet marks no claim of a batch prepared until the
    whole batch comes back without an error, and meanwhile appends the devices of each claim
    answered without one at every try (prepareResources in kubernetes/kubernetes
    pkg/kubelet/cm/dra/manager.go; ClaimInfo.addDevice): the container would get every CDI device
    once per try. So when a claim of a batch fails, the others are answered with an error too,
    naming it; they stay prepared here, and the retry answers them again from the checkpoint. A
    prepared claim is in the checkpoint before it is answered, so that it survives a restart.

    With ``peers``, a claim not prepared yet is refused while a newer pod of the driver serves
    (_prepare_one says why): only the newest pod's configuration reaches new containers.

    With ``metadata_dir`` (DraConfig.metadata_dir) and ``device_metadata``, each claim prepared
    gets its device metadata files there (device_metadata_files) and a CDI device per request that
    mounts its file into the containers; an unprepare removes a claim's files there whether
    ``device_metadata`` is on or not (it may have been on when the claim was prepared)."""

    def __init__(
        self,
        resources: DraResources,
        checkpoint: ClaimCheckpoint,
        api: Any,
        peers: DriverPeers | None = None,
        metadata_dir: str = "",
        device_metadata: bool = True,
    ) -> None:
        self.resources = resources
        self.checkpoint = checkpoint
        self.api = api
        self.peers = peers
        self.metadata_dir = metadata_dir
        self.device_metadata = device_metadata and bool(metadata_dir)
        self.pre_start_slots = trio.CapacityLimiter(PRE_START_CONCURRENCY)
        # Prepared claims whose device status is still to be written: write_statuses() writes them
        # after their answers went, so that a slow API server delays no pod's start.
        self._statuses, self._status_queue = trio.open_memory_channel[tuple[Any, list[dict[str, Any]]]](math.inf)

    async def prepare(self, request: Any) -> Any:
        with _timed(lambda metrics: metrics.prepare):
            return await self._prepare(request)

    async def _prepare(self, request: Any) -> Any:
        response = drapb.NodePrepareResourcesResponse()
        # The answer is a map by claim UID: a claim listed twice, prepared twice, would get every
        # device twice in its one entry.
        claims = {claim.uid: claim for claim in request.claims}
        async with trio.open_nursery() as nursery:
            for claim in claims.values():
                nursery.start_soon(self._prepare_one, claim, response)
        failed = [claim for claim in claims.values() if response.claims[claim.uid].error]
        if failed:
            # The kubelet would keep the others' devices from this try and add them again at the
            # next (the class's docstring): none is handed over until every claim of the batch is.
            first = failed[0]
            why = (
                f"held back until ResourceClaim {first.namespace}/{first.name} ({first.uid}) of the same request "
                f"is prepared too: {response.claims[first.uid].error}"
            )
            for claim in claims.values():
                if not response.claims[claim.uid].error:
                    del response.claims[claim.uid].devices[:]
                    response.claims[claim.uid].error = why
        return response

    async def _prepare_one(self, claim: Any, response: Any) -> None:
        answer = response.claims[claim.uid]
        specs: list[tuple[ClaimCDISpec, dict[str, Any]]] = []
        metadata: list[DeviceMetadataFile] = []
        try:
            if (devices := self.checkpoint.answer(claim.uid)) is not None:
                # Prepared before (maybe by the other pod of a rolling update): the same answer
                # again, and its own CDI devices and metadata files there again (a reboot empties
                # /var/run/cdi; the CDI mount of a missing file fails the container's start).
                for cdi, spec in self.checkpoint.cdi_specs(claim.uid):
                    if not os.path.exists(cdi.spec_file):
                        await trio.to_thread.run_sync(write_cdi_spec, cdi, spec)
                for path, text in self.checkpoint.metadata_files(claim.uid):
                    await trio.to_thread.run_sync(_ensure_device_metadata, path, text)
                answer.devices.extend(devices)
                return
            # After a kubelet restart the pods of a rolling update register in the order its plugin
            # watcher meets them: the old pod may be asked, and its configuration may not be the
            # newest's (whose CDI spec is on the node: CDISpecTurn). So it hands over: the claim's
            # answer is an error, and the kubelet asks again ("will be called again for those that
            # are not prepared", kubernetes/kubelet pkg/apis/dra/v1/api.proto), by then of the
            # newest pod. Only a newer pod the kubelet registered counts (DriverPeers): one it does
            # not call leaves this pod to prepare.
            if self.peers is not None and (newer := self.peers.newer(registered=True)[0]):
                raise GopherplugError(
                    f"a newer pod of DRA driver {self.resources.driver} serves on this node ({newer}): it prepares "
                    "new claims, and the kubelet asks again"
                )
            # The API server is asked outside the checkpoint's flock, as the Go helper does its slow
            # calls before serializing: the other pod of a rolling update waits for a write, not this.
            with trio.fail_after(API_REQUEST_TIMEOUT):
                found = await self.api.get_claim(claim.namespace, claim.name)
            pools = self.resources.pools()
            devices = prepared_devices(found, claim.uid, self.resources.driver, pools)
            # pre_start under DRA: before any CDI device of the claim exists (or container starts)
            for pool in dict.fromkeys(device.pool_name for device in devices):  # a pool per resource
                if (resource := pools[pool][0]).pre_start:  # its devices in the claim's order, as Allocate's
                    by_name = {dra_device_name(entry.id): entry for entry in pools[pool][1].values()}
                    chosen = [by_name[device.device_name] for device in devices if device.pool_name == pool]
                    await run_pre_start(resource, chosen, self.pre_start_slots)
            # The claim's own CDI devices (its requests' env, its shares) exist before the kubelet
            # hears their names (it may create the container at once); should the checkpoint then
            # fail, they are removed below.
            for cdi, spec in claim_cdi_specs(found, self.resources.driver, pools):
                specs.append((cdi, spec))
                await trio.to_thread.run_sync(write_cdi_spec, cdi, spec)
            if self.device_metadata:
                # KEP-5304: the files are written by checkpoint.add, with the entry naming them;
                # their CDI spec before, in the spec directory of the claim's first device's resource
                # (one the runtime reads, or that device would not reach the container either).
                metadata = device_metadata_files(found, self.resources.driver, pools, self.metadata_dir)
                first = pools[devices[0].pool_name][0].cdi
                assert first is not None  # parse_config gives every DRA resource one
                if made := device_metadata_cdi_spec(claim.uid, self.resources.driver, metadata, first.spec_dir):
                    specs.append(made)
                    await trio.to_thread.run_sync(write_cdi_spec, *made)
                add_metadata_cdi_devices(devices, self.resources.driver, claim.uid, metadata)
            devices = await self.checkpoint.add(claim, devices, specs, metadata)
        except trio.TooSlowError:
            answer.error = f"the API server did not answer within {API_REQUEST_TIMEOUT:g} s"
        except GopherplugError as error:
            answer.error = error.message if isinstance(error, RPCError) else str(error)  # pre_start's, uncoded
        else:
            answer.devices.extend(devices)
            names = ", ".join(device.device_name for device in devices)
            log.info("prepared ResourceClaim %s/%s (%s): %s", claim.namespace, claim.name, claim.uid, names)
            self._statuses.send_nowait(
                (claim, claim_device_status(found, self.resources.driver, self.resources.pools()))
            )
            return
        for cdi, _ in specs:  # not prepared: its CDI devices go (the kubelet asks again)
            with contextlib.suppress(GopherplugError):
                await trio.to_thread.run_sync(write_cdi_spec, cdi, None)
        if metadata and self.checkpoint.answer(claim.uid) is None:  # and its metadata, unless the other pod's
            with contextlib.suppress(GopherplugError):
                await trio.to_thread.run_sync(
                    remove_claim_metadata, self.metadata_dir, claim.namespace, claim.name, claim.uid
                )
        log.warning("cannot prepare ResourceClaim %s/%s (%s): %s", claim.namespace, claim.name, claim.uid, answer.error)

    async def write_statuses(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Write the device status of each claim prepared, in the order prepared, until cancelled:
        after the answer, which the pod's start waits for (the status is for people and controllers)."""
        task_status.started()
        async for claim, devices in self._status_queue:
            await self._write_status(claim, devices)

    async def _write_status(self, claim: Any, devices: list[dict[str, Any]]) -> None:
        """The claim's status.devices for this driver (claim_device_status), once it is prepared.
        Information only: a failure is logged, and the prepare stands."""
        if not devices:
            return
        try:
            with trio.fail_after(API_REQUEST_TIMEOUT):
                await self.api.apply_claim_status(
                    claim.namespace, claim.name, claim.uid, devices, self.resources.driver
                )
        except trio.TooSlowError:
            problem = f"the API server did not answer within {API_REQUEST_TIMEOUT:g} s"
        except GopherplugError as error:
            problem = str(error)
        else:
            return
        log.warning(
            "ResourceClaim %s/%s (%s) is prepared, but its device status is not written: %s",
            claim.namespace,
            claim.name,
            claim.uid,
            problem,
        )

    async def unprepare(self, request: Any) -> Any:
        response = drapb.NodeUnprepareResourcesResponse()
        for claim in request.claims:
            answer = response.claims[claim.uid]  # every claim gets an entry, even one we never knew
            try:
                # Its own CDI devices first: should that fail, the claim stays in the checkpoint,
                # and the kubelet's next try removes them.
                for cdi, _ in self.checkpoint.cdi_specs(claim.uid):
                    await trio.to_thread.run_sync(write_cdi_spec, cdi, None)
                if self.metadata_dir:  # its device metadata files, once no container can mount them
                    await trio.to_thread.run_sync(
                        remove_claim_metadata, self.metadata_dir, claim.namespace, claim.name, claim.uid
                    )
                if await self.checkpoint.remove(claim.uid):
                    log.info("unprepared ResourceClaim %s/%s (%s)", claim.namespace, claim.name, claim.uid)
            except GopherplugError as error:
                answer.error = str(error)
        return response


#: How soon a newer pod that does not serve is asked again (DriverPeers), at first and at most
#: (doubling in between): a starting pod listens within milliseconds, and the kubelet registers it
#: within a second or two; a killed, wedged or unregistered one is asked about twice a minute.
DRA_PEER_RECHECK = (0.05, 30.0)


def dra_registration_socket_of(driver: str, name: str) -> bool:
    """Whether a file name in plugins_registry is a registration socket of a pod of ``driver``, as
    DraConfig.registration_socket names them ("dra-<hash>-reg.sock" aside). Not any
    "<driver>-*-reg.sock": another driver's name may begin with ours and a "-"
    (gopherplug.example.com-nic)."""
    if name == f"{driver}-reg.sock":
        return True
    middle = name.removeprefix(f"{driver}-").removesuffix("-reg.sock")
    if len(middle) != len(name) - len(driver) - len("--reg.sock"):
        return False
    return bool(_UUID.fullmatch(middle) or re.fullmatch(r"[A-Za-z0-9_-]{11}", middle))


#: How long a newer pod's registration socket and its endpoint have to answer the questions that
#: tell whether it serves (DriverPeers._serves): the kubelet gives GetInfo one second too.
DRA_PEER_TIMEOUT = 1.0


class DriverPeers:
    """The other pods of this DRA driver on the node, seen through their registration sockets.
    During a rolling update both pods keep the slices, and the new one may describe the devices
    otherwise: both writing what they see would rewrite each other's slices without end. So the
    newest pod that serves writes them (and the CDI specs: CDISpecTurn), the older leaving them to
    it until it is gone (docs/dra.md, "Upgrades without a gap", tells the whole story).

    Newest: the later socket's change time. This pod's own is remembered, since it removes its
    socket first as it stops; and a stopping pod (``stopping``, set by serve_dra) never takes the
    turn back: it would write its own configuration once more over the new pod's.

    Serving, not merely accepting: the kernel accepts a connection into a wedged pod's listen
    backlog. ``watch`` asks whenever a socket comes or goes, and again with a backoff
    (DRA_PEER_RECHECK) while a newer pod is not seen registered: whether its socket answers GetInfo
    as this driver within DRA_PEER_TIMEOUT (``newer()``), and whether its endpoint's gopherplug
    status says the kubelet registered it (``newer(registered=True)``; an endpoint without that
    status counts once it answers). The kubelet calls the newest plugin that is registered and
    connected (GetPlugin in kubernetes/kubernetes pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go):
    until then it calls this one, which prepares new claims (ClaimPreparer)."""

    def __init__(self, config: DraConfig, changed: Watched | None = None) -> None:
        self.config = config
        #: touched when a socket comes or goes in plugins_registry, and when a newer pod is seen to serve
        self.changed = changed if changed is not None else Watched(None)
        #: set by serve_dra as it stops: from then on newer() never answers "none" after naming one
        self.stopping = False
        self._mine: tuple[int, str] | None = None  # our socket's (change time, name), as last seen
        # A newer socket -> (its (inode, change time), how far its pod serves), as _check last found.
        self._serving: dict[str, tuple[tuple[int, int], int]] = {}
        self._said = ["", ""]  # newer()'s last answers before stopping, without and with ``registered``

    def _newer_sockets(self) -> list[tuple[str, tuple[int, int]]]:
        """The driver's registration sockets newer than ours, each with its (inode, change time);
        none while ours was never seen (this pod starts by publishing)."""
        ours = self.config.registration_socket
        with contextlib.suppress(OSError):  # gone: compared as it was (this pod stops)
            self._mine = (os.lstat(ours).st_ctime_ns, os.path.basename(ours))
        if self._mine is None:
            return []
        registry = os.path.dirname(ours)
        found = []
        for name in _listing(registry):
            path = os.path.join(registry, name)
            if path == ours or not dra_registration_socket_of(self.config.driver, name):
                continue
            with contextlib.suppress(OSError):
                status = os.lstat(path)
                if stat.S_ISSOCK(status.st_mode) and (status.st_ctime_ns, name) > self._mine:
                    found.append((path, (status.st_ino, status.st_ctime_ns)))
        return found

    def newer(self, registered: bool = False) -> tuple[str, bool]:
        """The registration socket of a running pod of the driver newer than this one ("" if none;
        ``registered``: one the kubelet registered), and whether a newer socket's pod is not (yet)
        seen so. No I/O but a directory listing: asked under the CDI spec's flock."""
        level = _REGISTERED if registered else _ANSWERS
        answer, unserved = "", False
        for path, identity in self._newer_sockets():
            known = self._serving.get(path)
            if known is not None and known[0] == identity:
                serves = known[1] >= level
            else:
                # Not asked yet (_check is on its way): one that accepts counts as running for now,
                # or this pod would write over a new pod's first slices and spec in the meantime.
                serves = not registered and _accepts(path)
            if serves:
                answer, unserved = path, False
                break
            unserved = True
        if self.stopping:
            # A stopping pod that left the turn to a newer one does not take it back on its way out.
            said = self._said[registered]
            return (said, False) if said and not answer else (answer, unserved)
        self._said[registered] = answer
        return answer, unserved

    async def watch(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Touch ``changed`` at every change of plugins_registry, and find out which newer pods
        serve (_check), until cancelled."""
        events = flags.CREATE | flags.DELETE | flags.MOVED_FROM | flags.MOVED_TO
        registry = Watched(None)  # touched at every change of plugins_registry
        with DirectoryWatch(os.path.dirname(self.config.registration_socket), events) as watch:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._keep_checking, registry)
                task_status.started()
                async with contextlib.aclosing(watch.batches()) as batches:
                    async for _ in batches:
                        registry.touch()
                        self.changed.touch()
                nursery.cancel_scope.cancel()

    async def _keep_checking(self, registry: Watched) -> None:
        """_check at every change of plugins_registry; while a newer pod does not serve, again after
        DRA_PEER_RECHECK's backoff (registering takes the kubelet up to a second or two after the
        socket appears, and nothing in plugins_registry changes when it has)."""
        delay = DRA_PEER_RECHECK[0]
        while True:
            touched = registry.next_touch()  # taken before _check: a change during it is not missed
            if await self._check():
                with trio.move_on_after(delay):
                    await touched.wait()
                delay = DRA_PEER_RECHECK[0] if touched.is_set() else min(delay * 2, DRA_PEER_RECHECK[1])
            else:
                await touched.wait()
                delay = DRA_PEER_RECHECK[0]

    async def _check(self) -> bool:
        """Ask each newer socket not seen registered yet how far its pod serves; touch ``changed``
        when an answer is new. Returns whether one is not registered (yet)."""
        verdicts, unregistered, changed = {}, False, False
        for path, identity in self._newer_sockets():
            known = self._serving.get(path)
            if known is not None and known == (identity, _REGISTERED):
                verdicts[path] = known
                continue
            level = await self._serves(path)
            verdicts[path] = (identity, level)
            unregistered |= level < _REGISTERED
            changed |= verdicts[path] != known
        self._serving = verdicts  # sockets gone are forgotten
        if changed:
            self.changed.touch()
        return unregistered

    async def _serves(self, path: str) -> int:
        """How far the pod behind the registration socket ``path`` serves (the class's docstring):
        0, _ANSWERS or _REGISTERED. Asked as a probe (PROBE_METADATA): the other pod does not count
        our GetInfo as its kubelet's."""
        method, request = DRA_METHODS[GET_INFO], pluginregistration.InfoRequest()
        try:
            info = await call_unary(path, method, request, timeout=DRA_PEER_TIMEOUT, metadata=(PROBE_METADATA,))
        except RPCError:
            return 0  # wedged, still starting, or dead
        if info.name != self.config.driver:
            return 0
        try:
            status = await call_unary(info.endpoint, GET_STATUS, v1beta1.Empty(), timeout=DRA_PEER_TIMEOUT)
        except RPCError as error:
            # UNIMPLEMENTED: it answers, but says nothing of its registration
            return _REGISTERED if error.code == StatusCode.UNIMPLEMENTED else _ANSWERS
        return _REGISTERED if status.registered else _ANSWERS


#: How far a newer pod serves (DriverPeers): its socket answers GetInfo; the kubelet registered it.
_ANSWERS, _REGISTERED = 1, 2


class SlicePublisher:
    """Keeps this node's ResourceSlices of the driver equal to the devices, with no polling.

    Two tasks: ``watch`` follows the slices (a watch narrowed to this node and driver) into
    ``known``, and this node's Node into ``node`` (list_and_watch says how); ``publish`` wakes
    whenever a resource's devices, ``known`` or ``node`` change, and writes only what differs: a
    pool's devices in slices of at most DRA_MAX_DEVICES_PER_SLICE, all of one new generation. A
    slice deleted by someone else (the kubelet cleaning up after a plugin it thought gone) is
    written again. Each pool, and each stale slice, is written on its own, one the API server
    refuses retried after its own capped backoff (or Retry-After); writes that succeed are bounded
    too (DRA_WRITES_PER_SECOND). While the API server is down the plugin serves on.

    A resource whose name the Node's status.allocatable still counts (more than 0) is held back: a
    device plugin serves it here, and the scheduler would give the same devices to claims through
    DRA. The kubelet reports 0 once that plugin's endpoint is gone (GetCapacity in
    kubernetes/kubernetes pkg/kubelet/cm/devicemanager/manager.go), and the watch of the Node brings
    it within moments, in either direction. The scheduler follows the same rule from its side
    (filterExtendedResources in pkg/scheduler/framework/plugins/dynamicresources/extendeddynamicresources.go).

    The Node also owns the slices, so that they go with it. A Node that cannot be read must not keep
    the devices from the scheduler: the slices go out without an owner (said once), and get it once
    the Node is seen. A ClusterRole with get on nodes but no list and watch: the Node is read every
    DRA_NODE_POLL_SECONDS instead. With ``peers``, nothing is written while a newer pod serves."""

    def __init__(self, resources: DraResources, api: Any, peers: DriverPeers | None = None) -> None:
        self.resources = resources
        self.api = api
        self.peers = peers
        #: the registration socket of the newer pod the slices are left to ("" while this one writes them)
        self.deferring = Watched("")
        self.known: dict[str, dict[str, Any]] = {}  # slice name -> as the API server last told us
        self.known_changed = Watched(None)
        self.synced = Watched(0)  #: touched (and counted) after each pass that left the slices right
        self.listed = trio.Event()  # set once `known` holds a whole list
        self._seen = -1  # the newest resourceVersion listed or watched: a write's answer older is stale
        self._writes = _TokenBucket(DRA_WRITES_PER_SECOND, DRA_WRITE_BURST)
        # Pool name (or "stale <slice name>") -> (the next backoff, when it may be tried again).
        self._retries: dict[str, tuple[float, float, str]] = {}  # key -> (next delay, due, the error said)
        # Slice name -> (what we wrote, what the API server stored), as _slice_key, when the server
        # dropped fields it does not know (feature gates off): then what it stored counts as written.
        self._stored_as: dict[str, tuple[str, str]] = {}
        self._dropped_warned: set[str] = set()
        self._server_version: str | None = None  #: the API server's /version, once a warning needs it
        self._kubelet_version = ""  #: the node's kubeletVersion last said (_say_kubelet_version)
        #: What the slices need of this node's Node: {"uid": ..., "allocatable": {name: quantity}},
        #: or None when there is none or it cannot be read (_node_problem says why)
        self.node = Watched(None)
        self.node_known = trio.Event()  # set once the Node was listed or read, or failed to be
        self._node_problem = ""
        self._owner_warned = False
        #: Resource name -> the Node's allocatable for it, while it is more than 0 and the resource's
        #: devices are held back from DRA
        self.held: dict[str, str] = {}

    async def watch(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Follow the slices into ``known`` and the Node into ``node``, until cancelled."""
        node, driver = self.resources.node_name, self.resources.driver
        listing = functools.partial(self.api.list_slices, node, driver)
        watching = functools.partial(self.api.watch_slices, node, driver)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch_node)
            works = _works_later(task_status)  # started again: it runs again once the API server answers
            task_status.started()
            await list_and_watch("ResourceSlices", listing, watching, self._listed_slices, self._slice_event, works)

    def _listed_slices(self, items: list[dict[str, Any]], version: str) -> None:
        self.known = {item["metadata"]["name"]: item for item in items}
        self._seen = int(version) if version.isascii() and version.isdigit() else -1
        self.listed.set()
        self.known_changed.touch()

    def _slice_event(self, kind: str, item: dict[str, Any]) -> None:
        # A bookmark's version counts as seen: every event before it has come.
        if (number := _version_of(item)) is not None:
            self._seen = max(self._seen, number)
        if kind == "BOOKMARK":
            return
        name = item["metadata"]["name"]
        # The watch brings events in order; what can be newer than an event is `known`'s own entry,
        # the answer to our write. An event older than it is history, a deletion too: a slice we
        # created at version W is not the one a DELETED at D < W describes (dropping it would create
        # it again, for a 409). client-go's MutationCache compares versions as numbers too (_older).
        if _older(item, self.known.get(name)):
            pass
        elif kind == "DELETED":
            self.known.pop(name, None)
        else:
            self.known[name] = item
        self.known_changed.touch()

    async def _watch_node(self) -> None:
        """Watch the Node; while RBAC refuses that (403), read it every DRA_NODE_POLL_SECONDS, and
        try the watch again after DRA_NODE_WATCH_RETRY: a ClusterRole fixed later is noticed."""
        name = self.resources.node_name
        polled = False  # the Node is being read instead of watched, and it was said
        retry = DRA_NODE_WATCH_RETRY[0]

        def listed(items: list[dict[str, Any]], version: str) -> None:
            nonlocal polled, retry
            if polled:
                log.info("DRA: Node %s can be listed and watched again: it is watched instead of read", name)
                polled, retry = False, DRA_NODE_WATCH_RETRY[0]
            self._set_node(items[0] if items else None, "")

        listing, watching = functools.partial(self.api.list_node, name), functools.partial(self.api.watch_node, name)
        while True:
            try:
                await list_and_watch(
                    f"Node {name}", listing, watching, listed, self._node_event, stop_when_forbidden=True
                )
            except ApiError as error:  # 403: the ClusterRole has no list or watch on nodes
                if not polled:
                    log.warning(
                        "DRA: %s (the ClusterRole needs list and watch on nodes, as in daemonset-dra.yaml); Node %s "
                        "is read every %g to %g s instead, and a change of its allocatable is seen that late; "
                        "watching it is tried again from time to time",
                        error,
                        name,
                        DRA_NODE_POLL_SECONDS,
                        DRA_NODE_POLL_SECONDS * (1 + DRA_JITTER),
                    )
                else:  # said once: the same answer again is no news
                    log.debug("DRA: %s; Node %s is still read instead", error, name)
                polled = True
                with trio.move_on_after(jittered(retry)):
                    await self._poll_node()
                retry = min(retry * 2, DRA_NODE_WATCH_RETRY[1])

    def _node_event(self, kind: str, item: dict[str, Any]) -> None:
        if kind == "DELETED":
            self._set_node(None, f"Node {self.resources.node_name} was deleted")
        elif kind != "BOOKMARK":
            self._set_node(item, "")

    async def _poll_node(self) -> None:
        """Read the Node every DRA_NODE_POLL_SECONDS (jittered) into ``node``, until cancelled."""
        name = self.resources.node_name
        delay = DRA_WATCH_BACKOFF[0]
        while True:
            try:
                self._set_node(await self.api.get_node(name), "")
                wait = jittered(DRA_NODE_POLL_SECONDS)
            except ApiError as error:
                if error.status in (403, 404):
                    why = "the ClusterRole needs get on nodes, as in daemonset-dra.yaml" if error.status == 403 else ""
                    self._set_node(None, f"{error} ({why})" if why else str(error))
                    wait = jittered(DRA_NODE_POLL_SECONDS)
                else:  # the API server's failure: asked again sooner
                    log.warning("DRA: %s; again in %.2g s", error, wait := jittered(delay))
                    delay = min(delay * 2, DRA_WATCH_BACKOFF[1])
            await trio.sleep(wait)

    def _set_node(self, found: Mapping[str, Any] | None, problem: str) -> None:
        """What the slices need of the Node (``node``), or None and why not."""
        self._node_problem = problem or f"Node {self.resources.node_name} not found"
        if found is None:
            self.node.set(None)
        else:
            status = found.get("status") or {}
            allocatable = status.get("allocatable") or {}
            uid = str(found.get("metadata", {}).get("uid") or "")
            self.node.set({"uid": uid, "allocatable": {key: str(value) for key, value in allocatable.items()}})
            self._say_kubelet_version(str((status.get("nodeInfo") or {}).get("kubeletVersion") or ""))
        self.node_known.set()

    def _say_kubelet_version(self, version: str) -> None:
        """What this node's kubelet (status.nodeInfo.kubeletVersion) cannot do of what gopherplug
        serves, said once per version: before 1.36 it opens the DRA health stream only with its
        ResourceHealthStatus gate, off by default (kubernetes/kubernetes pkg/kubelet/cm/dra/plugin)."""
        if not version or version == self._kubelet_version:
            return
        self._kubelet_version = version
        if (found := re.match(r"v?1\.(\d+)\.", version)) is not None and int(found[1]) < 36:
            log.warning(
                "DRA: node %s's kubelet is %s: before 1.36 it opens the devices' health stream only with its "
                "feature gate ResourceHealthStatus on (off by default), so per-device health reaches the pods' "
                "status only then; unhealthy devices are still kept from claims by the slices' healthy attribute",
                self.resources.node_name,
                version,
            )

    async def publish(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        if self.listed.is_set():  # started again (_supervised): not trusting what a failed run left in
            # ``known`` (an answer it failed on), listed anew, the newest: the watch goes on from there.
            self._listed_slices(*await self.api.list_slices(self.resources.node_name, self.resources.driver, ""))
        await self.listed.wait()
        await self.node_known.wait()  # a resource its allocatable counts must not be published first
        while True:
            # Whatever changes while a pass is writing wakes the next pass.
            woken = trio.Event()
            watched = [self.known_changed, self.node, self.resources.changed]
            watched += [devices for _, devices in self.resources.served.values()]
            watched += [self.peers.changed] if self.peers is not None else []
            touches = [one.next_touch() for one in watched]  # taken before _sync reads anything
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_any_event, touches, woken)
                # A newer pod not seen serving yet is DriverPeers' to ask again: it touches
                # peers.changed when the answer changes.
                if self._defer():
                    await woken.wait()  # until a socket goes (or anything else changes): asked again
                    nursery.cancel_scope.cancel()
                    continue
                retry_at = await self._sync()
                if retry_at is not None:  # a pool or a stale slice waits for its retry
                    with trio.move_on_at(retry_at):
                        await woken.wait()
                    nursery.cancel_scope.cancel()
                    continue
                self.synced.set(self.synced.value + 1)
                await woken.wait()
                nursery.cancel_scope.cancel()

    def _defer(self) -> bool:
        """Whether a newer pod of the driver writes the slices now (said in the log when that
        changes; DriverPeers.newer)."""
        newer = self.peers.newer()[0] if self.peers is not None else ""
        if newer != self.deferring.value:
            driver = self.resources.driver
            if newer:
                log.info("DRA: a newer pod of driver %s serves (%s): the slices are left to it", driver, newer)
            else:
                log.info("DRA: no newer pod of driver %s serves any more: writing the slices again", driver)
            self._retries.clear()  # whatever was due is compared again from scratch
            self.deferring.set(newer)
        return bool(newer)

    def _owner(self) -> str:
        """The Node's UID ("" when it is not known: the slices go out without an owner, said once),
        once the resources its allocatable counts are held back (_hold)."""
        node = self.node.value
        if node is None:
            if not self._owner_warned:
                self._owner_warned = True
                name = self.resources.node_name
                why = f" (is {name} this node's name?)" if self._node_problem.endswith("not found") else ""
                log.warning(
                    "DRA: %s%s; the ResourceSlices are published without the Node as their owner, so nothing "
                    "deletes them with the Node",
                    self._node_problem,
                    why,
                )
            return ""  # what is held back stays so until the Node is seen again
        self._hold(node["allocatable"])
        return str(node["uid"])

    def _hold(self, allocatable: Mapping[str, str]) -> None:
        """Hold back the resources the Node's allocatable still counts; release those it no longer does."""
        node = self.resources.node_name
        held = {}
        for resource, _ in self.resources.served.values():
            # A quantity ("2", "0", "1k") is more than 0 when it has a digit other than 0: the
            # kubelet writes a device plugin's healthy count there, a whole number.
            quantity = str(allocatable.get(resource.name, "0"))
            if any(digit in quantity for digit in "123456789"):
                held[resource.name] = quantity
        for name, quantity in held.items():
            if name not in self.held:
                log.warning(
                    "DRA: %s: node %s's allocatable still has %s of it: a device plugin serves it on this node, "
                    "so its devices are held back from DRA until that is 0 (a node serves a resource through "
                    "one API: stop the device plugin here, see docs/dra.md: Moving a resource from the device "
                    "plugin to DRA)",
                    name,
                    node,
                    quantity,
                )
        for name in self.held.keys() - held.keys():
            log.info("DRA: %s: node %s's allocatable for it is 0 now: its devices are offered to DRA", name, node)
        self.held = held

    async def _sync(self) -> float | None:
        """One pass: every pool's slices as they should be, stale ones deleted, each on its own (the
        Go controller's per-pool work queue) with its own backoff. Returns when the next retry is
        due (trio's clock), None if none is."""
        node, driver, taint = self.resources.node_name, self.resources.driver, self.resources.unhealthy_taint
        owner = self._owner()
        now = trio.current_time()
        pools = []
        for resource, devices in list(self.resources.served.values()):
            if devices.value is not RETIRED and resource.name not in self.held:
                pool = dra_pool_name(node, resource.name)
                slices = resource_slices(driver, node, resource, devices.value, 0, owner, taint)
                pools.append((pool, resource, len(devices.value), slices))
        # Every pool's slices are wanted, also those of a pool waiting for its retry.
        wanted = {item["metadata"]["name"] for *_, slices in pools for item in slices}
        jobs: list[tuple[str, Callable[[], Awaitable[None]]]] = [
            (pool, functools.partial(self._sync_pool, pool, resource.name, count, slices, owner))
            for pool, resource, count, slices in pools
        ]
        jobs += [(f"stale {name}", functools.partial(self._delete, name)) for name in self.known if name not in wanted]
        for key, job in jobs:
            if (retry := self._retries.get(key)) is not None and retry[1] > now:
                continue  # not yet: its backoff is running
            try:
                await job()
            except ApiError as error:
                if _metrics is not None:
                    # A stale slice's delete belongs to no configured pool: "". So does the write of
                    # a pool whose resource was removed while it was under way: its series is gone
                    # with the resource (Metrics.forget), and must not come back.
                    mine = key in {dra_pool_name(node, name) for name in self.resources.served}
                    _metrics.api_errors.labels(key if mine else "").inc()
                delay, said = (retry[0], retry[2]) if retry is not None else (_API_BACKOFF[0], "")
                wait = jittered(max(delay, error.retry_after or 0.0))
                self._retries[key] = (min(delay * 2, _API_BACKOFF[1]), trio.current_time() + wait, str(error))
                # One line when a pool's writes begin to fail (or fail otherwise), one when they work.
                retrying = "DRA: writing ResourceSlices: %s; tried again until it works (next in %.2g s)"
                log.log(logging.DEBUG if str(error) == said else logging.WARNING, retrying, error, wait)
            else:
                if self._retries.pop(key, None) is not None:
                    log.info("DRA: writing ResourceSlices (%s) works again", key)
        # Retries of pools or slices no longer there are forgotten.
        keys = {key for key, _ in jobs}
        self._retries = {key: retry for key, retry in self._retries.items() if key in keys}
        return min((due for _, due, _ in self._retries.values()), default=None)

    async def _delete(self, name: str) -> None:
        await self._writes.acquire()
        await self.api.delete_slice(name)
        self.known.pop(name, None)

    async def _sync_pool(
        self, pool: str, resource_name: str, count: int, slices: list[dict[str, Any]], owner: str
    ) -> None:
        """One pool's slices as ``slices`` say, all of one generation."""
        mine = {name: item for name, item in self.known.items() if item["spec"]["pool"]["name"] == pool}
        generation = max((item["spec"]["pool"]["generation"] for item in mine.values()), default=0)
        same = len(mine) == len(slices) and all(
            self._written(item, mine.get(item["metadata"]["name"])) for item in slices
        )
        # A slice of an older generation than its pool's newest is obsolete even when its devices
        # are right: the scheduler takes only a pool's newest generation, complete (structured/pools.go).
        # So a write that failed halfway through a new generation leaves the pool to be written again.
        if same and all(item["spec"]["pool"]["generation"] == generation for item in mine.values()):
            return
        # The pool changed: a new generation, so that the scheduler never mixes two.
        for item in slices:
            item["spec"]["pool"]["generation"] = generation + 1
            _keep_taint_times(item, mine.values())
            name = item["metadata"]["name"]
            await self._writes.acquire()
            if name in self.known:
                item["metadata"]["resourceVersion"] = self.known[name]["metadata"]["resourceVersion"]
                if not owner and "ownerReferences" in self.known[name]["metadata"]:
                    # The Node is unknown for now, not gone: an update keeps the owner it had.
                    item["metadata"]["ownerReferences"] = self.known[name]["metadata"]["ownerReferences"]
                written = await self.api.replace_slice(item)
            else:
                written = await self.api.create_slice(item)
            # While the request was out, the watch may have brought this very write and a
            # deletion after it: then the answer is history, and `known` is already right.
            if (number := _version_of(written)) is None or number > self._seen:
                self.known[name] = written
            self._stored_as.pop(name, None)
            if not _same_slice(item, written):
                # Stored other than written: an API server whose feature gates are off drops the
                # fields it does not know, on every write. Said once per pool, as the Go controller
                # does (DroppedFieldsError), and what it stored counts as written from now on.
                self._stored_as[name] = (_slice_key(item), _slice_key(written))
                if pool not in self._dropped_warned:
                    self._dropped_warned.add(pool)
                    # Which release drops them, for the lines below: asked only now, once.
                    if self._server_version is None:
                        self._server_version = await self.api.server_version() or "of a version it does not say"
                    server = f"the API server ({self._server_version})"
                    log.warning(
                        "DRA: %s stored ResourceSlice %s without some of what was written (fields it does not "
                        "know: are the feature gates they need off?); it is not written again for them",
                        server,
                        name,
                    )
                    if _dropped("allowMultipleAllocations", item, written):
                        log.warning(
                            "DRA: %s dropped allowMultipleAllocations from the devices of %s: its feature gate "
                            "DRAConsumableCapacity is off (beta and on by default from Kubernetes 1.36): each device "
                            "goes to one claim at a time, and its replicas share nothing until the gate is on",
                            server,
                            resource_name,
                        )
                    if _dropped("taints", item, written):
                        log.warning(
                            "DRA: %s dropped the taints of the unhealthy devices of %s: its feature gate "
                            "DRADeviceTaints is off (beta and on by default from Kubernetes 1.36). A DeviceClass "
                            "that selects on the healthy attribute (the shipped ones do) still keeps them from "
                            "claims; one that does not gives them out, and the pods that get them never start",
                            server,
                            resource_name,
                        )
        log.info("DRA: %s: %s in pool %s", resource_name, _devices(count), pool)

    def _written(self, wanted: Mapping[str, Any], known: Mapping[str, Any] | None) -> bool:
        """Whether the slice on the server is ``wanted`` as written, or as the server stored it."""
        if _same_slice(wanted, known):
            return True
        stored = self._stored_as.get(wanted["metadata"]["name"])
        return known is not None and stored == (_slice_key(wanted), _slice_key(known))


def _dropped(field: str, written: Mapping[str, Any], stored: Mapping[str, Any]) -> bool:
    """Whether the API server stored a slice's devices that have ``field`` ("taints": the tainted
    ones; "allowMultipleAllocations": the shared ones, dra_shares) without it."""
    mine = [device["name"] for device in written["spec"].get("devices") or [] if device.get(field)]
    theirs = {device.get("name"): device for device in stored.get("spec", {}).get("devices") or []}
    return any(not theirs.get(name, {}).get(field) for name in mine)


def _version_of(item: Mapping[str, Any]) -> int | None:
    """An object's resourceVersion as a number (etcd's one increasing counter), None if it is not
    one: then it is taken as the newest, as a client that never compares the opaque versions does."""
    version = item.get("metadata", {}).get("resourceVersion", "")
    return int(version) if version.isascii() and version.isdigit() else None


def _older(item: Mapping[str, Any], than: Mapping[str, Any] | None) -> bool:
    """Whether ``item`` is an older version of the object ``than`` (a watch event that arrives after
    the answer to our own later write)."""
    if than is None:
        return False
    mine, theirs = _version_of(item), _version_of(than)
    return mine is not None and theirs is not None and mine < theirs


def _untimed(spec: Mapping[str, Any]) -> dict[str, Any]:
    """A slice's spec without its taints' timeAdded: the API server adds one to a taint written
    without it, which gopherplug's are, so a taint as stored reads as written."""
    spec = dict(spec)
    if any("taints" in device for device in spec.get("devices") or []):
        spec["devices"] = [
            {**device, "taints": [{k: v for k, v in taint.items() if k != "timeAdded"} for taint in device["taints"]]}
            if "taints" in device
            else device
            for device in spec["devices"]
        ]
    return spec


def _keep_taint_times(item: dict[str, Any], stored: Iterable[Mapping[str, Any]]) -> None:
    """Give each taint of ``item`` the timeAdded its device's same taint (key, value, effect) has in
    the pool's ``stored`` slices. The API server sets timeAdded to now on every write of a taint
    without one (SetDefaults_DeviceTaint in kubernetes/kubernetes pkg/apis/resource/v1/defaults.go),
    and a NoExecute taint evicts at timeAdded + tolerationSeconds: every rewrite of the pool would
    restart the eviction clock. The Go helper does the same (copyTaintTimeAdded), here across the
    pool's slices, so that a device moved to another slice keeps its time too."""
    times = {
        (device.get("name"), taint.get("key"), taint.get("value"), taint.get("effect")): taint["timeAdded"]
        for known in stored
        for device in known.get("spec", {}).get("devices") or []
        for taint in device.get("taints") or []
        if taint.get("timeAdded")
    }
    for device in item["spec"].get("devices") or []:
        for taint in device.get("taints") or []:
            kept = times.get((device["name"], taint.get("key"), taint.get("value"), taint.get("effect")))
            if kept and not taint.get("timeAdded"):
                taint["timeAdded"] = kept


def _slice_key(item: Mapping[str, Any]) -> str:
    """A slice's spec and owners, its generation (and taints' timeAdded) aside, as one comparable text."""
    spec = _untimed(item["spec"])
    spec["pool"] = {key: value for key, value in spec["pool"].items() if key != "generation"}
    owners = item.get("metadata", {}).get("ownerReferences")
    return json.dumps({"spec": spec, "owners": owners}, sort_keys=True)


def _same_slice(wanted: Mapping[str, Any], known: Mapping[str, Any] | None) -> bool:
    """Whether a slice on the server already says what ``wanted`` says (the generation aside), and
    is owned as wanted (a slice written by a version that set no owner is written again, once)."""
    if known is None:
        return False
    owners = wanted["metadata"].get("ownerReferences")
    if owners is not None and known.get("metadata", {}).get("ownerReferences") != owners:
        return False
    a, b = _untimed(wanted["spec"]), _untimed(known["spec"])
    a_pool, b_pool = dict(a.pop("pool")), dict(b.pop("pool"))
    a_pool.pop("generation"), b_pool.pop("generation")
    return a == {key: b.get(key) for key in a} and a_pool == b_pool


@dataclass
class DraDriver:
    """What serve_dra reports once it serves: for tests, probes and the demo."""

    config: DraConfig
    resources: DraResources
    registration: RegistrationState
    claims: ClaimPreparer
    slices: SlicePublisher


async def serve_dra(
    config: DraConfig,
    resources: DraResources,
    api: Any,
    *,
    task_status: trio.TaskStatus[DraDriver] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Be the DRA driver ``config`` names until cancelled: slices published, DRAPlugin served,
    the registration socket in plugins_registry for the kubelet to find. started() is called once
    both sockets listen, the DRAPlugin socket first: the kubelet dials it as soon as GetInfo names it.

    With ``config.pod_uid`` (a DaemonSet's pod), another pod of the driver may serve beside this
    one (a rolling update with maxSurge): the sockets carry the pod's UID; the checkpoint, the CDI
    spec and the slices are shared, each under its own rules (ClaimCheckpoint, CDISpecTurn,
    SlicePublisher), and only this pod's sockets go on the way out. Without a pod UID, a second
    driver is refused at start while the first one's registration socket answers.

    Cancelled, it stops its parts one at a time, the last started first (_Parts)."""
    try:
        os.makedirs(config.plugin_dir, mode=0o750, exist_ok=True)
    except OSError as error:
        raise GopherplugError(f"cannot make {config.plugin_dir}: {_describe(error)}") from None
    if not config.pod_uid and _accepts(config.registration_socket):
        # Two would serve on the same paths, each replacing the other's sockets as _keep_serving does.
        raise GopherplugError(
            f"DRA driver {config.driver} is already served on this node ({config.registration_socket} answers): "
            f"stop that one, or give each its pod's UID in {POD_UID_ENV} to run two at once (a rolling update)"
        )
    _remove_dead_sockets(config)
    await _serve_dra(config, resources, api, task_status)


def _remove_dead_sockets(config: DraConfig) -> None:
    """Remove the driver's sockets that no process listens on: left by a pod of the driver that was
    killed (SIGKILL, the OOM killer) before it could remove them.

    The kubelet's plugin watcher retries a registration socket that does not answer after every
    start, and keeps a dead endpoint among the driver's plugins. A socket nobody accepts on is dead
    for certain (a live pod listens from bind() until it removes it). Only this driver's names
    (dra_registration_socket_of), and in the driver's own directory "dra.sock", "dra-*.sock"."""
    registry = os.path.dirname(config.registration_socket)
    candidates = [
        os.path.join(registry, name) for name in _listing(registry) if dra_registration_socket_of(config.driver, name)
    ]
    candidates += [
        os.path.join(config.plugin_dir, name)
        for name in _listing(config.plugin_dir)
        if name == "dra.sock" or fnmatch.fnmatchcase(name, "dra-*.sock")
    ]
    for path in candidates:
        with contextlib.suppress(OSError):
            if path not in (config.registration_socket, config.endpoint) and stat.S_ISSOCK(os.lstat(path).st_mode):
                if not _accepts(path):
                    os.unlink(path)
                    log.info("removed %s, left by a DRA driver that did not exit cleanly", path)


def _listing(directory: str) -> list[str]:
    try:
        return sorted(os.listdir(directory))
    except OSError:
        return []


async def _serve_dra(
    config: DraConfig, resources: DraResources, api: Any, task_status: trio.TaskStatus[DraDriver]
) -> None:
    peers = DriverPeers(config, resources.cdi_turn.changed)
    checkpoint = ClaimCheckpoint(config.checkpoint, config.serialize_lock)
    try:
        for path in await checkpoint.remove_stale_metadata(config.metadata_dir):
            log.info("removed %s, the device metadata of a claim that is not prepared any more", path)
    except GopherplugError as error:  # the flock: the first prepare will say it again
        log.warning("DRA: cannot look for stale device metadata: %s", error)
    claims = ClaimPreparer(resources, checkpoint, api, peers, config.metadata_dir, config.device_metadata)
    driver = DraDriver(config, resources, RegistrationState(), claims, SlicePublisher(resources, api, peers))
    async with trio.open_nursery() as nursery:
        # Stopped in the reverse order: the registration socket first, so that the kubelet's plugin
        # watcher deregisters this pod (and a rolling update's other pod gets the kubelet's calls)
        # before the DRAPlugin socket goes; the API server's side after the kubelet's.
        parts = _Parts(nursery)
        try:
            await parts.start("peer watch", peers.watch)
            await parts.start("slice watch", driver.slices.watch)
            await parts.start("slice publisher", driver.slices.publish)
            await parts.start("claim status writer", driver.claims.write_statuses)
            await parts.start(
                "DRAPlugin server",
                _keep_serving,
                config.endpoint,
                lambda: dra_plugin_services(resources, driver.claims, driver.registration),
            )
            await parts.start(
                "registration server",
                _keep_serving,
                config.registration_socket,
                lambda: [registration_service(config, driver.registration)],
            )
            # Listening: from now on an older pod sees this one, and leaves the CDI specs to it.
            resources.cdi_turn.take(lambda: peers.newer()[0])
            log.info("DRA driver %s on node %s: %s", config.driver, resources.node_name, config.registration_socket)
            task_status.started(driver)
            with _health_check(f"DRA driver {config.driver}", functools.partial(_dra_problem, driver)):
                await trio.sleep_forever()
        finally:
            peers.stopping = True  # its registration socket goes first: no turn taken back on the way out
            await parts.stop()


def _dra_problem(driver: DraDriver) -> str:
    """The DRA driver's liveness: registered by the kubelet, not refused, not dropped since (see
    RegistrationState.dropped); "" when so."""
    status = driver.registration.message(driver.config.driver)
    if status.registration_error:
        return f"the kubelet refused it: {status.registration_error}"
    if status.dropped:
        return f"the kubelet registered it, then seems to have dropped it: {status.dropped}"
    return "" if status.registered else f"no kubelet has registered it in {status.unregistered_seconds:.0f} s"


async def _keep_serving(
    socket_path: str,
    services: Callable[[], list[purerpc.Service]],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve on ``socket_path``, and again whenever the socket file is deleted or replaced."""
    directory = os.path.dirname(socket_path)
    events = flags.CREATE | flags.DELETE | flags.MOVED_FROM | flags.MOVED_TO
    with DirectoryWatch(directory, events) as watch:
        async with contextlib.aclosing(watch.batches()) as batches:
            await _keep_serving_in(directory, socket_path, services, batches, task_status)


async def _keep_serving_in(
    directory: str,
    socket_path: str,
    services: Callable[[], list[purerpc.Service]],
    batches: AsyncGenerator[Any, None],
    task_status: trio.TaskStatus[None],
) -> None:
    while True:
        try:
            os.makedirs(directory, mode=0o750, exist_ok=True)
        except OSError as error:
            raise GopherplugError(f"cannot make {directory}: {_describe(error)}") from None
        async with trio.open_nursery() as nursery:
            try:
                server = await nursery.start(serve_grpc, socket_path, services())
            except FileNotFoundError:
                continue  # the directory went between makedirs and bind(): make it again
            except OSError as error:
                raise GopherplugError(f"cannot serve on {socket_path}: {_describe(error)}") from None
            task_status.started()
            task_status = trio.TASK_STATUS_IGNORED
            while server.owns_socket_file():
                await batches.__anext__()
            log.warning("%s was deleted: serving it again", socket_path)
            nursery.cancel_scope.cancel()


# 6e. The API server: its client, credentials, list and watch ------------------------------------------
#: Where a pod finds its service account's token and the API server's CA (in-cluster configuration).
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


#: How long a token read from a file is used before the file is read again (client-go's
#: cachingTokenSource in transport/token_source.go: one minute). The kubelet refreshes a projected
#: token at 80 % of its life, at least an hour: a minute-old token is never the expired one.
TOKEN_REREAD_SECONDS = 60.0


def _token_file_auth(httpx2: Any, path: str) -> Any:
    """An httpx2 authentication that sends the bearer token in ``path``: read again once it is
    TOKEN_REREAD_SECONDS old (jittered), and after a 401 or 403, when the request is sent once more if the
    file holds another token (a refusal of the same token again is the server's last word)."""

    class TokenFileAuth(httpx2.Auth):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            self.bearer: str | None = None
            self.read_at = -math.inf
            self.spread = 1.0  # this read's jitter: TOKEN_REREAD_SECONDS times this, until the next read

        def read(self) -> None:
            try:
                with open(path, encoding="utf-8") as file:
                    self.bearer = f"Bearer {file.read().strip()}"
            except OSError:
                pass  # being replaced, or gone: the last token, or none (the server says 401)
            self.read_at = time.monotonic()
            self.spread = jittered(1.0)

        def auth_flow(self, request: Any) -> Generator[Any, Any, None]:
            if time.monotonic() - self.read_at >= TOKEN_REREAD_SECONDS * self.spread:
                self.read()
            sent = self.bearer
            if sent is not None:
                request.headers["Authorization"] = sent
            response = yield request
            if response.status_code in (401, 403):
                self.read()
                if self.bearer is not None and self.bearer != sent:
                    request.headers["Authorization"] = self.bearer
                    yield request

    return TokenFileAuth()


#: The ExecCredential versions client-go accepts from a kubeconfig's exec plugin (apiVersions in
#: client-go's plugin/pkg/client/auth/exec/exec.go): v1alpha1 was removed in Kubernetes 1.24.
EXEC_CREDENTIAL_VERSIONS = ("client.authentication.k8s.io/v1", "client.authentication.k8s.io/v1beta1")

#: How long an exec credential plugin may run before it is killed and the request fails. client-go
#: gives it no deadline: kubectl's user sees a command hang and presses Ctrl-C. A driver has no one
#: to do that, and every request waits for the plugin's one run.
EXEC_CREDENTIAL_TIMEOUT = 60.0

#: At most this much of a plugin's stdout is kept: an ExecCredential is a few KiB (a token, or a
#: certificate chain); a plugin that prints without end fails instead of filling our memory.
EXEC_CREDENTIAL_MAX_OUTPUT = 1 << 20


class ExecCredentialPlugin:
    """A kubeconfig user's ``exec`` credential plugin (``aws eks get-token``, ``kubelogin get-token``),
    run as client-go runs it (plugin/pkg/client/auth/exec/exec.go), under trio: lightkube 1.0.1 runs
    it through asyncio, which has no event loop under trio. docs/dra.md says the contract.

    - The command: a bare name looked up on PATH; one with a slash relative to the kubeconfig's
      directory (clientcmd's ResolveLocalPaths). Its environment: ours, the kubeconfig's ``env``,
      then KUBERNETES_EXEC_INFO (spec.interactive always false; spec.cluster only with
      ``provideClusterInfo: true``, as client-go's rest.ConfigToExecCluster makes it).
    - Its stdout: an ExecCredential whose status.token is sent until status.expirationTimestamp. A
      401 runs the plugin again (unless another request has since), and the request is sent once
      more with the new token, as _token_file_auth does (client-go returns the 401).
    - One run at a time (a lock, as client-go's mutex), run_program's, within EXEC_CREDENTIAL_TIMEOUT.

    Not supported, each refused with a line that says what to do: interactiveMode Always (a plugin
    that must prompt), and a client certificate in place of a token (status.clientCertificateData
    and clientKeyData: httpx2 sets a connection's certificate when the client is made, not per
    request). Problems in the kubeconfig raise GopherplugError at once (connect fails with it); a
    run that gives no credential raises ExecCredentialError, naming the user and the command."""

    def __init__(
        self, user: str, config: Mapping[str, Any], cluster: Mapping[str, Any], kubeconfig: str | os.PathLike[str]
    ) -> None:
        self.user = user
        command = config.get("command")
        base = os.path.dirname(os.path.abspath(kubeconfig))
        if not isinstance(command, str) or not command:
            raise GopherplugError(f"kubeconfig {kubeconfig}: user {user!r}: exec has no command")
        # kubectl's error for a relative path to the plugin is a missing file in its cwd; clientcmd
        # resolves one with a slash against the kubeconfig's directory, a bare name stays a PATH lookup.
        self.command = command if "/" not in command else os.path.join(base, command)
        self.shown = f"kubeconfig user {user!r}: exec credential plugin {command}"
        args, env = config.get("args") or [], config.get("env") or []
        if not isinstance(args, list) or not all(isinstance(arg, str) for arg in args):
            raise GopherplugError(f"{self.shown}: exec.args must be a list of strings")
        if not isinstance(env, list) or not all(
            isinstance(entry, dict) and isinstance(entry.get("name"), str) and isinstance(entry.get("value"), str)
            for entry in env
        ):
            raise GopherplugError(f"{self.shown}: exec.env must be a list of name and value strings")
        self.args: list[str] = list(args)
        self.env = {entry["name"]: entry["value"] for entry in env}
        self.api_version = config.get("apiVersion")
        if self.api_version not in EXEC_CREDENTIAL_VERSIONS:
            raise GopherplugError(
                f"{self.shown}: exec.apiVersion {self.api_version!r} is not one client-go accepts: "
                f"use {' or '.join(EXEC_CREDENTIAL_VERSIONS)}"
            )
        # clientcmd requires interactiveMode in a v1 exec and defaults a v1beta1 one to IfAvailable.
        # IfAvailable and Never both run here without a terminal; Always means the plugin needs one.
        mode = config.get("interactiveMode") or "IfAvailable"
        if mode not in ("Never", "IfAvailable", "Always"):
            raise GopherplugError(f"{self.shown}: exec.interactiveMode {mode!r}: Never, IfAvailable or Always")
        if mode == "Always":
            raise GopherplugError(
                f"{self.shown}: interactiveMode Always needs a terminal to prompt at, and gopherplug runs the "
                "plugin without one: log in with the plugin first (its cached login is used) or give it a "
                "non-interactive way to get the token, and set interactiveMode: Never"
            )
        self.install_hint = " ".join(str(config.get("installHint") or "").split())
        self.cluster = self._cluster_info(cluster, base) if config.get("provideClusterInfo") else None
        self.token: str | None = None
        self.expires = math.inf  # the wall-clock time.time() the token expires at
        self._lock = trio.Lock()

    def _cluster_info(self, cluster: Mapping[str, Any], base: str) -> dict[str, Any]:
        """spec.cluster as client-go's rest.ConfigToExecCluster builds it: the CA as data (base64
        in JSON, as Go marshals []byte), read from certificate-authority if that is all there is."""
        info: dict[str, Any] = {"server": str(cluster.get("server") or "")}
        ca = cluster.get("certificate-authority-data")
        if not ca and cluster.get("certificate-authority"):
            try:
                with open(os.path.join(base, cluster["certificate-authority"]), "rb") as file:
                    ca = base64.b64encode(file.read()).decode()
            except OSError as error:
                raise GopherplugError(
                    f"{self.shown}: cannot read the cluster's certificate-authority for provideClusterInfo: "
                    f"{_describe(error)}"
                ) from None
        for key, value in (
            ("tls-server-name", cluster.get("tls-server-name")),
            ("insecure-skip-tls-verify", cluster.get("insecure-skip-tls-verify")),
            ("certificate-authority-data", ca),
            ("proxy-url", cluster.get("proxy-url")),
            ("disable-compression", cluster.get("disable-compression")),
        ):
            if value:  # omitempty, as client-go's JSON
                info[key] = value
        for extension in cluster.get("extensions") or []:
            if isinstance(extension, dict) and extension.get("name") == "client.authentication.k8s.io/exec":
                info["config"] = extension.get("extension")
        return info

    @classmethod
    def from_kubeconfig(cls, path: str | os.PathLike[str], user: str, cluster: str) -> ExecCredentialPlugin:
        """The exec plugin of ``user`` in the kubeconfig at ``path``, for ``cluster``. Read from the
        file itself: lightkube's model of it keeps neither provideClusterInfo nor interactiveMode,
        nor a cluster's extensions."""
        try:
            with open(path, encoding="utf-8") as file:
                document = yaml.safe_load(file)
        except (OSError, yaml.YAMLError) as error:
            raise GopherplugError(f"kubeconfig {path}: {_describe(error)}") from None

        def named(section: str, name: str, field: str) -> dict[str, Any]:
            for entry in (document or {}).get(section) or []:
                if isinstance(entry, dict) and entry.get("name") == name and isinstance(entry.get(field), dict):
                    return dict(entry[field])
            return {}

        return cls(user, named("users", user, "user").get("exec") or {}, named("clusters", cluster, "cluster"), path)

    def _error(self, what: str) -> ExecCredentialError:
        return ExecCredentialError(f"{self.shown}: {what}")

    async def current(self) -> str:
        """The token to send: the one had before, until it expires; else the plugin's next one."""
        async with self._lock:
            if self.token is None or time.time() >= self.expires:
                await self._run()
            assert self.token is not None
            return self.token

    async def refused(self, sent: str) -> str:
        """The token to send after the API server refused ``sent`` (401): a new run's, unless another
        request has had one since (client-go's maybeRefreshCreds)."""
        async with self._lock:
            if self.token == sent:
                await self._run()
            assert self.token is not None
            return self.token

    async def _run(self) -> None:
        """Run the plugin and take its token (ExecCredentialError if it gives none)."""
        spec: dict[str, Any] = {"interactive": False}
        if self.cluster is not None:
            spec["cluster"] = self.cluster
        request = {"apiVersion": self.api_version, "kind": "ExecCredential", "spec": spec}
        env = {**os.environ, **self.env, "KUBERNETES_EXEC_INFO": json.dumps(request)}
        # Looked up on our own PATH, as Go's exec.Command does before the kubeconfig's env applies.
        executable = self.command if "/" in self.command else shutil.which(self.command)
        if executable is None or not os.path.exists(executable):
            hint = f": {self.install_hint}" if self.install_hint else ""
            where = " on PATH" if "/" not in self.command else ""
            raise self._error(f"{self.command} not found{where}{hint}")
        try:
            with trio.fail_after(EXEC_CREDENTIAL_TIMEOUT):
                ran = await run_program([executable, *self.args], env, limit=EXEC_CREDENTIAL_MAX_OUTPUT)
        except trio.TooSlowError:
            raise self._error(f"did not finish within {EXEC_CREDENTIAL_TIMEOUT:g} s (killed)") from None
        except OSError as error:
            raise self._error(f"cannot run it: {_describe(error)}") from None
        if ran.stdout is None:
            raise self._error(f"printed more than {EXEC_CREDENTIAL_MAX_OUTPUT} bytes, not an ExecCredential")
        if ran.returncode != 0:
            raise self._error(f"{ran.how()}{ran.said()}")
        if ran.stderr.strip():  # client-go passes a plugin's stderr through to kubectl's: a warning, a notice
            log.info("%s said%s", self.shown, ran.said())
        self.token, self.expires = self._credential(ran.stdout)

    def _credential(self, stdout: bytes) -> tuple[str, float]:
        """The token and its expiry (time.time(); math.inf: none) in the plugin's ExecCredential."""
        try:
            credential = json.loads(stdout)
        except ValueError as error:  # UnicodeDecodeError included
            # Not one byte of it in the message, which is logged at every retry: a plugin that prints
            # a bare token (a common mistake, and what `gcloud auth print-access-token` does) would
            # put the credential into the log. json's own message names a position, never the text.
            what = f"{len(stdout)} bytes" if stdout.strip() else "nothing"
            raise self._error(
                f"printed {what}, not ExecCredential JSON ({error}); not shown here, as it may be a credential"
            ) from None
        if not isinstance(credential, dict) or credential.get("kind") != "ExecCredential":
            raise self._error("printed JSON that is not an ExecCredential (kind ExecCredential)")
        if credential.get("apiVersion") != self.api_version:
            raise self._error(
                f"answered apiVersion {credential.get('apiVersion')!r}, the kubeconfig asks for {self.api_version}: "
                "set exec.apiVersion to the one the plugin speaks"
            )
        status = credential.get("status")
        if not isinstance(status, dict):
            raise self._error("printed an ExecCredential without a status")
        token = status.get("token")
        if status.get("clientCertificateData") or status.get("clientKeyData"):
            if not isinstance(token, str) or not token:
                raise self._error(
                    "answered a client certificate (status.clientCertificateData), which gopherplug does not "
                    "use: have the plugin print a token, or put the certificate in the kubeconfig "
                    "(client-certificate-data and client-key-data)"
                )
            log.warning("%s: answered a token and a client certificate: the token alone is sent", self.shown)
        if not isinstance(token, str) or not token:
            raise self._error("printed an ExecCredential without status.token")
        expiry = status.get("expirationTimestamp")
        if expiry is None:
            return token, math.inf
        try:
            when = datetime.datetime.fromisoformat(str(expiry))
            if when.tzinfo is None:
                raise ValueError("no time zone offset")
        except ValueError as error:
            raise self._error(f"status.expirationTimestamp {expiry!r} is not an RFC 3339 time ({error})") from None
        return token, when.timestamp()


def _exec_credential_auth(httpx2: Any, plugin: ExecCredentialPlugin) -> Any:
    """An httpx2 authentication that sends ``plugin``'s bearer token (ExecCredentialPlugin), its
    plugin run in the request's own trio task: async_auth_flow, never the event loop blocked."""

    class ExecCredentialAuth(httpx2.Auth):  # type: ignore[misc,name-defined]
        def sync_auth_flow(self, request: Any) -> Generator[Any, Any, None]:
            raise GopherplugError(f"{plugin.shown}: runs for an async client only")
            yield request  # a generator, as httpx2 calls it

        async def async_auth_flow(self, request: Any) -> AsyncGenerator[Any, Any]:
            sent = await plugin.current()
            request.headers["Authorization"] = f"Bearer {sent}"
            response = yield request
            if response.status_code == 401:
                token = await plugin.refused(sent)
                if token != sent:  # the same token again: the 401 is the answer
                    request.headers["Authorization"] = f"Bearer {token}"
                    yield request

    return ExecCredentialAuth()


#: Modules that lightkube 1.0.1, httpx2 and httpcore2 import at their own import and a DRA driver
#: never runs, with what they cost in RSS on CPython 3.11 (bench/RESULTS.md, bench_dra.py --stages):
#: - asyncio, for lightkube's exec credentials (asyncio.create_subprocess_exec, which needs an
#:   asyncio event loop: under trio they cannot run, and ExecCredentialPlugin runs the kubeconfig's
#:   plugin in their place) and the sleep of its own watch's retries
#:   (gopherplug watches by itself, list_and_watch): 1.5 MiB with concurrent.futures and _asyncio;
#: - lightkube's models and resources of the core group, about 500 classes with their docstrings,
#:   of which the driver needs the Node alone and reads it as a dict (KubeApi.get_node): 1.6 MiB;
#: - 0.35 MiB together: msgspec's encoders other than JSON and its type introspection (lightkube
#:   uses msgspec.json and msgspec.structs), csv (importlib.metadata reads a package's RECORD with
#:   it; httpx2's and httpcore2's version() read its METADATA only), truststore (httpcore2's trust
#:   store on Windows and macOS; on Linux it loads the system's CA files itself, and lightkube
#:   gives it the kubeconfig's CA anyway) and mimetypes (httpx2's multipart uploads).
#: _import_api_client leaves each in sys.modules unexecuted until an attribute of it is asked for
#: (_UnloadedModule): transparent to any code that does use one. Only when gopherplug is the
#: program (_OWNS_PROCESS: the gopherplug command, as the images run it): a program that embeds
#: gopherplug owns its sys.modules, and gets every module imported as it always is.
API_CLIENT_UNUSED = tuple(
    "asyncio asyncio.subprocess lightkube.models.core_v1 lightkube.resources.core_v1 msgspec.inspect msgspec.msgpack "
    "msgspec.toml msgspec.yaml csv truststore mimetypes".split()
)

#: Whether gopherplug is the program (main() run as the command, its arguments from sys.argv), not
#: a library imported by another one: then it may decide what this process's sys.modules holds.
_OWNS_PROCESS = False

#: Held while an _UnloadedModule runs its code: a second thread asking for an attribute meanwhile waits.
_UNLOADED_LOCK = threading.RLock()


class _UnloadedModule(types.ModuleType):
    """A module in sys.modules whose code has not run yet: its spec, name, file and (for a package)
    path are set, as the import system sets them before it runs a module, so that ``import name``
    and ``from package import name`` find it there and return it as they would a module imported
    already, without running it (the standard library's importlib.util.LazyLoader runs a module
    at its first attribute lookup of any kind, and an import statement looks up ``__spec__``: a
    module lightkube imports by name would run at once). Its code runs at the first lookup of an
    attribute it does not have (_run_unloaded), in this module object, which then is an ordinary
    module."""

    def __getattr__(self, name: str) -> Any:
        if _run_unloaded(self):
            return getattr(self, name)
        # Its own code, while it runs, looking up what it has not set yet: missing, as in any module.
        raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")


def _run_unloaded(module: _UnloadedModule) -> bool:
    """Run the code of ``module``, an _UnloadedModule, its package's first if that is one too (the
    import system runs a package before its modules: asyncio.subprocess imports from asyncio what
    asyncio's own code sets); False if its code is running already, in this thread. A failure
    removes it from sys.modules, as a failed import does, and raises."""
    with _UNLOADED_LOCK:
        if type(module) is not _UnloadedModule:
            return True  # run meanwhile: by another thread, or by its package's code
        if module.__dict__.get("_gopherplug_running"):
            return False
        package = sys.modules.get(module.__name__.rpartition(".")[0])
        if isinstance(package, _UnloadedModule):
            _run_unloaded(package)
            if type(module) is not _UnloadedModule:
                return True
        module.__dict__["_gopherplug_running"] = True
        try:
            module.__spec__.loader.exec_module(module)  # type: ignore[union-attr]
        except BaseException:
            sys.modules.pop(module.__name__, None)
            raise
        finally:
            del module.__dict__["_gopherplug_running"]
        module.__class__ = types.ModuleType  # type: ignore[assignment]
        return True


def _leave_unloaded(names: Iterable[str]) -> None:
    """Put each module of ``names`` not imported yet in sys.modules as an _UnloadedModule. Its spec
    is found from its parents' specs, without importing them (importlib.util.find_spec would
    import the parent package, here lightkube, and with it everything this is to avoid)."""
    import importlib.machinery
    import importlib.util

    specs = []
    for name in names:
        if name in sys.modules:
            continue  # imported already (an embedder's program, a test run): nothing left to save
        first, *rest = name.split(".")
        spec = importlib.util.find_spec(first)
        for depth in range(1, len(rest) + 1):
            if spec is None or spec.submodule_search_locations is None:
                break
            dotted = ".".join([first, *rest[:depth]])
            spec = importlib.machinery.PathFinder.find_spec(dotted, spec.submodule_search_locations)
        # Python code alone: an extension module is made whole by module_from_spec, run or not.
        if spec is not None and isinstance(spec.loader, importlib.machinery.SourceFileLoader):
            specs.append(spec)
    for spec in specs:  # only once every spec is found: finding one looks at the others' parents
        module = importlib.util.module_from_spec(spec)
        module.__class__ = _UnloadedModule
        sys.modules[spec.name] = module


def _import_api_client() -> tuple[Any, Any]:
    """Import httpx2 and lightkube (with lightkube.generic_resource), for KubeApi.connect and
    check-config alike, leaving API_CLIENT_UNUSED unexecuted; returns (httpx2, lightkube). Raises
    ImportError when the dra extra is missing."""
    if _OWNS_PROCESS:
        _leave_unloaded(API_CLIENT_UNUSED)
    import httpx2
    import lightkube
    import lightkube.generic_resource

    # What an import would have set: the module as an attribute of its package.
    for name in API_CLIENT_UNUSED:
        parent, _, child = name.rpartition(".")
        module, package = sys.modules.get(name), sys.modules.get(parent)
        if module is not None and package is not None and child not in package.__dict__:
            setattr(package, child, module)
    return httpx2, lightkube


def _field_selector(fields: Mapping[str, str]) -> str:
    """A field selector of equalities, as the API server reads one ("spec.nodeName=node-1,...")."""
    return ",".join(f"{key}={value}" for key, value in fields.items())


class KubeApi:
    """The few requests a DRA driver makes to the API server, through lightkube: resource.k8s.io/v1
    only, so Kubernetes 1.34 or later (1.32 and 1.33 serve the beta versions alone).

    lightkube is imported here, not at the top: only a DRA driver needs it (the `dra` extra).
    Objects go in and come out as plain dicts; every failure becomes ApiError (``status`` None when
    no answer came). In a pod, the configuration is the service account's, its token file read
    again every TOKEN_REREAD_SECONDS and after a 401 or 403, as the kubelet rotates bound tokens;
    outside one, KUBECONFIG's, an exec credential plugin run under trio (ExecCredentialPlugin).

    Lists and watches are made as client-go's reflector makes them (list_and_watch), through
    lightkube's request building and its httpx2 client: lightkube 1.0.1's own list cannot ask for
    a resourceVersion, and its watch neither asks for bookmarks nor lets its caller see its end."""

    def __init__(
        self, client: Any, slice_type: Any, claim_type: Any, errors: tuple[Any, Any], node_type: Any = None
    ) -> None:
        self._client = client
        self._slice, self._claim, self._node = slice_type, claim_type, node_type
        self._api_error, self._transport_error = errors

    @classmethod
    def connect(
        cls,
        service_account_dir: str = SERVICE_ACCOUNT_DIR,
        field_manager: str = "gopherplug",
        kubeconfig: str | None = None,
        node_name: str = "",
    ) -> KubeApi:
        """A client configured from ``kubeconfig`` if given, else from the pod's service account,
        else from KUBECONFIG or ~/.kube/config; its user agent names ``node_name``."""
        try:
            httpx2, lightkube = _import_api_client()
            from lightkube.generic_resource import (
                GenericGlobalResource,
                create_api_info,
                create_global_resource,
                create_namespaced_resource,
            )
        except ImportError as error:
            raise GopherplugError(_DRA_EXTRA.format(error=error)) from None
        try:
            if kubeconfig is not None:
                config = lightkube.KubeConfig.from_file(kubeconfig)
            elif os.environ.get("KUBERNETES_SERVICE_HOST"):
                config = lightkube.KubeConfig.from_service_account(service_account_dir)
            else:
                config = lightkube.KubeConfig.from_env()
            chosen = config.get()  # the current context's cluster and user, as the client takes them
        except KeyError as error:  # lightkube reads a section the kubeconfig lacks: it says only 'contexts'
            where = kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
            problem = f"no Kubernetes API configuration: {where} has no {error.args[0]!r} section; a kubeconfig lists "
            problem += "clusters, users and contexts, and names its current-context (kubectl config view shows it)"
            raise GopherplugError(problem) from None
        except (lightkube.ConfigError, OSError) as error:
            raise GopherplugError(f"no Kubernetes API configuration: {error}") from None
        except yaml.YAMLError as error:
            # Where, never what: PyYAML's message quotes the lines around the mistake, and the lines of
            # a kubeconfig are tokens, keys and certificates.
            mark = getattr(error, "problem_mark", None)
            at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(error, "problem", None) or "not valid YAML"
            raise GopherplugError(
                f"no Kubernetes API configuration: {kubeconfig or 'the kubeconfig'}: {problem}{at} "
                "(the text is not shown: it may hold credentials)"
            ) from None
        # An exec credential plugin: lightkube runs it through asyncio, which has no event loop
        # under trio (ExecCredentialPlugin runs it itself). Only if the user has no other
        # credential: client-go's exec authenticator steps aside for one (UpdateTransportConfig).
        plugin = None
        user_fields = ("token", "token_file", "client_cert", "client_cert_data", "username")
        if (
            getattr(chosen.user, "exec", None) is not None
            and not any(getattr(chosen.user, field, None) for field in user_fields)
            and chosen.fname is not None
        ):
            user, cluster = chosen.context.user or "", chosen.context.cluster
            plugin = ExecCredentialPlugin.from_kubeconfig(chosen.fname, user, cluster)
        client = lightkube.AsyncClient(
            config, field_manager=field_manager, timeout=httpx2.Timeout(API_REQUEST_TIMEOUT), trust_env=False
        )
        # lightkube reads a token file again only after a 401: a token refused with 403 (one issued
        # before an upgrade, say) would be sent forever. client-go reads the file every minute; so
        # does this, and after a 401 or 403 (on lightkube 1.0.1's httpx2 client, pinned).
        user = getattr(client._client.config, "user", None)
        token_file = getattr(user, "token_file", None)
        if token_file:
            client._client._client.auth = _token_file_auth(httpx2, token_file)
        if plugin is not None:
            client._client._client.auth = _exec_credential_auth(httpx2, plugin)
        client._client._client.headers["User-Agent"] = user_agent(node_name)
        # httpx2 logs every request at INFO; gopherplug logs what each one was for, and failures.
        logging.getLogger("httpx2").setLevel(logging.WARNING)
        slices = create_global_resource("resource.k8s.io", "v1", "ResourceSlice", "resourceslices")
        claims = create_namespaced_resource("resource.k8s.io", "v1", "ResourceClaim", "resourceclaims")
        # The core group's Node as a generic resource (a dict), not registered: lightkube's own model
        # would load every core model (API_CLIENT_UNUSED), and create_global_resource() fails for
        # group "" in a second client.

        class Node(GenericGlobalResource):  # type: ignore[misc,valid-type]
            _api_info = create_api_info("", "v1", "Node", "nodes", verbs=["get", "list", "watch"])

        # lightkube's ApiError needs a Content-Type of exactly application/json, else a KeyError or
        # httpx's error comes out (a proxy's HTML 503, a charset): every error answer is httpx's here.
        client._client.raise_for_status = lambda response: response.raise_for_status()
        return cls(client, slices, claims, (httpx2.HTTPStatusError, httpx2.HTTPError), Node)

    @contextlib.contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        try:
            yield
        except self._api_error as error:
            # The API server's priority and fairness answers 429 with Retry-After (seconds), and so
            # may a proxy's 503; a client that comes back sooner only adds to the load it was refused for.
            response = error.response
            header = response.headers.get("retry-after", "").strip()
            retry_after = float(header) if header.isascii() and header.isdigit() else None
            try:
                status: Any = response.json()
            except ValueError:  # a proxy's HTML page, a body cut short: no Status
                status = None
            if not (isinstance(status, dict) and isinstance(status.get("message"), str)):
                shown = " ".join(response.text.split())[:120]
                status = {"message": f"{response.reason_phrase} (not the API server's Status: {shown})"}
            details = status.get("details") if isinstance(status.get("details"), dict) else {}
            causes = tuple(str(c.get("reason") or "") for c in details.get("causes") or [] if isinstance(c, dict))
            code = response.status_code
            raise ApiError(code, f"{what}: {code} {status['message']}", retry_after, causes) from None
        except ExecCredentialError as error:  # the kubeconfig's credential plugin gave no token
            raise ApiError(None, f"{what}: {error}") from None
        except ValueError as error:  # a 200 that is not JSON: mangled on its way, retried as any failure
            raise ApiError(None, f"{what}: an answer that is not JSON ({error})") from None
        except self._transport_error as error:  # no answer: refused, reset mid-body, timed out
            # httpx2's error for a server certificate the configured CA did not sign says nothing
            # (trio's BrokenResourceError inside): the reason, ssl's "CERTIFICATE_VERIFY_FAILED",
            # is further down its causes.
            cause: BaseException = error
            while not str(_innermost(cause)).strip() and (cause.__cause__ or cause.__context__) is not None:
                cause = cause.__cause__ or cause.__context__  # type: ignore[assignment]
            raise ApiError(None, f"{what}: {_describe(cause, silent='no answer')}") from None

    async def get_claim(self, namespace: str, name: str) -> dict[str, Any]:
        with self._errors(f"get ResourceClaim {namespace}/{name}"):
            return dict(await self._client.get(self._claim, name, namespace=namespace))

    async def apply_claim_status(
        self, namespace: str, name: str, uid: str, devices: list[dict[str, Any]], field_manager: str
    ) -> None:
        """Write ``devices`` as the claim's status.devices by server-side apply to its status
        subresource, as ``field_manager``: a list map, so each driver's apply replaces its own
        entries alone. The UID makes the API server refuse (409) a claim replaced under its name."""
        from lightkube.types import PatchType

        body = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace, "uid": uid},
            "status": {"devices": devices},
        }
        with self._errors(f"apply the status of ResourceClaim {namespace}/{name}"):
            await self._client.patch(
                self._claim.Status,
                name,
                body,
                namespace=namespace,
                patch_type=PatchType.APPLY,
                field_manager=field_manager,
                force=True,
            )

    async def get_node(self, name: str) -> dict[str, Any]:
        """The Node's name and UID (a slice's owner reference) and its status.allocatable."""
        with self._errors(f"get Node {name}"):
            node = _shaped(f"get Node {name}", "Node", dict(await self._client.get(self._node, name)))
            metadata, status = node["metadata"], node.get("status") or {}
            allocatable = status.get("allocatable") or {}
            return {
                "metadata": {"name": metadata.get("name"), "uid": metadata.get("uid")},
                "status": {"allocatable": {key: str(value) for key, value in allocatable.items()}},
            }

    async def server_version(self) -> str:
        """The API server's version as its /version says it ("v1.35.2"), for a log line that must
        name it; "" when it cannot be had. Decisions go by what the server stored, never by this:
        an admin may have turned a gate on before its default."""
        inner = self._client._client
        try:
            response = await inner.send(inner._client.build_request("GET", "/version"))
            inner.raise_for_status(response)
            return str(response.json().get("gitVersion") or "")
        except Exception as error:  # a log line's detail: never a reason to fail
            log.debug("DRA: the API server's /version: %s", _describe(error))
            return ""

    def _fields(self, node_name: str, driver: str) -> dict[str, str]:
        # Both are field selectors the API server supports for ResourceSlices.
        return {"spec.nodeName": node_name, "spec.driver": driver}

    async def _list(
        self, resource: Any, what: str, fields: Mapping[str, str], version: str
    ) -> tuple[list[dict[str, Any]], str]:
        """The objects of ``resource`` the field selector selects, as of ``version`` or newer ("0":
        any, "": the newest), and the list's resourceVersion. No limit: a list with one at a version
        other than "0" bypasses the watch cache for etcd (the reflector turns pagination off for the
        same reason, reflector.go), and these lists are short."""
        inner = self._client._client  # lightkube 1.0.1's GenericAsyncClient, pinned
        params = {"fieldSelector": _field_selector(fields), "resourceVersion": version or None}
        with self._errors(f"list {what}"):
            response = await inner.send(
                inner.build_adapter_request(inner.prepare_request("list", resource, params=params))
            )
            inner.raise_for_status(response)
            listed = response.json()
        if not isinstance(listed, dict) or not isinstance(items := listed.get("items") or [], list):
            raise ApiError(None, f"list {what}: an answer of the wrong shape (no list of items)")
        kind, metadata = "ResourceSlice" if resource is self._slice else "Node", listed.get("metadata") or {}
        return [_shaped(f"list {what}", kind, item) for item in items], str(metadata.get("resourceVersion") or "")

    async def _watch(
        self, resource: Any, what: str, fields: Mapping[str, str], version: str
    ) -> AsyncGenerator[tuple[str, dict[str, Any]], None]:
        """One watch request of ``resource`` from ``version``, with bookmarks: its events (ADDED,
        MODIFIED, DELETED, BOOKMARK) until the server ends it. An ERROR event (410 Gone, the
        version left the server's history) raises ApiError, as an error answer does; a line that is
        not an event, WatchEventError (_watch_event)."""
        inner = self._client._client
        params = {"fieldSelector": _field_selector(fields), "resourceVersion": version or None}
        # Bookmarks carry the newest resourceVersion even when nothing selected changed, so the
        # next watch starts from there, not from a version the server may have forgotten. No
        # timeoutSeconds: the server ends the watch after its --min-request-timeout (list_and_watch).
        params["allowWatchBookmarks"] = "true"
        shape = "ResourceSlice" if resource is self._slice else "Node"
        with self._errors(f"watch {what}"):
            built = inner.prepare_request("list", resource, watch=True, params=params)
            request = inner._client.build_request(
                built.method, built.url, params=built.params, timeout=inner._watch_timeout
            )
            response = await inner.send(request, stream=True)
            try:
                if response.status_code >= 400:
                    await response.aread()
                    inner.raise_for_status(response)
                # One event per line, and a line ends at the byte "\\n" alone: Go's json.Encoder
                # leaves U+0085 and other line breaks raw (go_json), where httpx's aiter_lines()
                # (and lightkube's watch) would split too: a Node annotation holding one cut its
                # event in two.
                pending = bytearray()
                async for chunk in response.aiter_bytes():
                    pending += chunk
                    while (end := pending.find(b"\n")) >= 0:
                        line = bytes(pending[:end])
                        del pending[: end + 1]
                        if line.strip():
                            kind, item = _watch_event(what, line)
                            yield kind, item if kind == "BOOKMARK" else _shaped(f"watch {what}", shape, item)
                # What is left was cut off mid-event by the connection's end: the next watch starts
                # from the last whole event's version, and brings this one again.
            finally:
                await response.aclose()

    async def list_slices(self, node_name: str, driver: str, version: str = "0") -> tuple[list[dict[str, Any]], str]:
        """This node's slices of the driver as of ``version`` or newer, and the version to watch from."""
        return await self._list(self._slice, "ResourceSlices", self._fields(node_name, driver), version)

    def watch_slices(
        self, node_name: str, driver: str, version: str
    ) -> AsyncGenerator[tuple[str, dict[str, Any]], None]:
        """One watch of this node's slices of the driver from ``version`` (_watch)."""
        return self._watch(self._slice, "ResourceSlices", self._fields(node_name, driver), version)

    async def list_node(self, name: str, version: str = "0") -> tuple[list[dict[str, Any]], str]:
        """The Node named ``name``, as a list of it alone (none if there is no such Node): a
        field selector on metadata.name, as the kubelet's own informer of its Node has (in
        kubernetes/kubernetes pkg/kubelet/kubelet.go), so that it can be watched from the list's version."""
        return await self._list(self._node, f"Node {name}", {"metadata.name": name}, version)

    def watch_node(self, name: str, version: str) -> AsyncGenerator[tuple[str, dict[str, Any]], None]:
        """One watch of the Node named ``name`` from ``version`` (_watch)."""
        return self._watch(self._node, f"Node {name}", {"metadata.name": name}, version)

    async def create_slice(self, item: dict[str, Any]) -> dict[str, Any]:
        with self._errors(what := f"create ResourceSlice {item['metadata']['name']}"):
            return _shaped(what, "ResourceSlice", dict(await self._client.create(self._slice(item))))

    async def replace_slice(self, item: dict[str, Any]) -> dict[str, Any]:
        with self._errors(what := f"update ResourceSlice {item['metadata']['name']}"):
            return _shaped(what, "ResourceSlice", dict(await self._client.replace(self._slice(item))))

    async def delete_slice(self, name: str) -> None:
        with self._errors(f"delete ResourceSlice {name}"):
            await self._client.delete(self._slice, name)

    async def aclose(self) -> None:
        await self._client.close()


#: The kinds of event a watch brings (k8s.io/apimachinery pkg/watch): ERROR ends it.
_WATCH_EVENT_TYPES = frozenset({"ADDED", "MODIFIED", "DELETED", "BOOKMARK", "ERROR"})


def _watch_event(what: str, line: bytes) -> tuple[str, dict[str, Any]]:
    """One line of a watch stream as its event: (type, object). An ERROR event (a 410 Gone) raises
    ApiError, as an error answer does; a line that is not an event raises WatchEventError, never
    what json.loads raises, or one bad line would stop the driver."""
    try:
        event = json.loads(line)
    except ValueError as error:  # UnicodeDecodeError included
        shown = line[:80].decode(errors="replace") + ("…" if len(line) > 80 else "")
        raise WatchEventError(f"watch {what}: a line that is not JSON ({error}): {shown}") from None
    kind = event.get("type") if isinstance(event, dict) else None
    item = event.get("object") if isinstance(event, dict) else None
    metadata = item.get("metadata", {}) if isinstance(item, dict) else None
    if kind not in _WATCH_EVENT_TYPES or not isinstance(item, dict) or not isinstance(metadata, dict):
        shown = line[:80].decode(errors="replace") + ("…" if len(line) > 80 else "")
        raise WatchEventError(f"watch {what}: a line that is not a watch event: {shown}")
    if kind == "ERROR":
        code = item.get("code")
        raise ApiError(code if isinstance(code, int) else None, f"watch {what}: {code} {item.get('message', '')}")
    return str(kind), item


def _shaped(what: str, kind: str, item: Any) -> dict[str, Any]:
    """``item`` if it has what the driver reads of a ``kind`` (metadata.name; a slice's spec.pool name
    and generation; a Node's status and allocatable, if there, mappings), else WatchEventError: list
    items and write answers are checked as watch events are, a wrong shape retried, not a KeyError."""
    metadata, spec = (item.get("metadata"), item.get("spec")) if isinstance(item, dict) else (None, None)
    pool = spec.get("pool") if isinstance(spec, dict) else None
    pooled = isinstance(pool, dict) and isinstance(pool.get("name"), str) and isinstance(pool.get("generation"), int)
    status = (item.get("status") or {}) if kind == "Node" else {}
    named = isinstance(metadata, dict) and isinstance(metadata.get("name"), str) and (pooled or kind != "ResourceSlice")
    if not named or not isinstance(status, dict) or not isinstance(status.get("allocatable") or {}, dict):
        raise WatchEventError(f"{what}: a {kind} of the wrong shape: {json.dumps(item)[:100]}")
    return dict(item)


def _too_large_version(error: ApiError) -> bool:
    """Whether the API server answered that a request's resourceVersion is newer than its watch
    cache has: a 504 whose details name the cause ResourceVersionTooLarge, or whose message says
    so (as client-go's isTooLargeResourceVersionError reads it, for a server that names no cause)."""
    return "ResourceVersionTooLarge" in error.causes or (
        error.status == 504 and "Too large resource version" in str(error)
    )


#: A watch that the server ends this soon after it opened, with nothing in it (not even a
#: bookmark), did not work: the reflector counts it as a failure ("very short watch"), and so does
#: list_and_watch, so that a proxy that ends each watch at once cannot make a hot loop of them.
DRA_SHORT_WATCH_SECONDS = 1.0


async def list_and_watch(
    what: str,
    list_from: Callable[[str], Awaitable[tuple[list[dict[str, Any]], str]]],
    watch_from: Callable[[str], AsyncGenerator[tuple[str, dict[str, Any]], None]],
    replace: Callable[[list[dict[str, Any]], str], None],
    update: Callable[[str, dict[str, Any]], None],
    answered: Callable[[], None] | None = None,
    *,
    stop_when_forbidden: bool = False,
) -> None:
    """Keep a copy of some objects of the API server, as client-go's reflector does (ListAndWatch in
    kubernetes/kubernetes staging/src/k8s.io/client-go/tools/cache/reflector.go), until cancelled:
    ``replace`` gets each list's items and version, ``update`` each watch event (ADDED, MODIFIED,
    DELETED, BOOKMARK). ``list_from(version)`` and ``watch_from(version)`` make one request each.
    docs/dra.md, "A light load on the API server", says what that costs the server.

    1. List once, at resourceVersion "0": from the API server's watch cache, not etcd.
    2. Watch from the list's version, asking for bookmarks; every event's version is where the
       next watch starts.
    3. The server ends each watch after its --min-request-timeout (30 to 60 minutes): watched
       again from the last version, with no list. No timeoutSeconds (the reflector's 5 to 10
       minutes would multiply the requests); a dead connection is found by the bookmarks'
       silence instead (DRA_WATCH_QUIET_SECONDS).
    4. A watch answered 410 Gone: list again from that version; a list answered 410 too, or "too
       large resource version" (a cache behind it), at "", a quorum read. A 410 right after a
       list is no longer routine: warned about, backed off.
    5. Any other failure: backed off (DRA_WATCH_BACKOFF, jittered), then watched again; never a
       list, which costs the server much more.

    A 403 is raised when ``stop_when_forbidden``, for a caller that can do without; otherwise
    backed off and retried as the others. ``answered``: a supervised task's "runs again" (_works_later),
    called at the first list: its failure said, the failures until then are debug lines here."""
    version = ""  # the last resourceVersion seen; "" before the first list
    list_at: str | None = "0"  # list before the next watch, at this version; None: watch
    delay = DRA_WATCH_BACKOFF[0]
    expired = 0  # 410s in a row, each right after a list, with nothing from the server in between
    failing = answered is not None  # a failure was said: the next ones are debug lines until an answer comes
    while True:
        try:
            if list_at is not None:
                try:
                    items, version = await list_from(list_at)
                except ApiError as error:
                    if not list_at or not (error.status == 410 or _too_large_version(error)):
                        raise
                    # The version is gone from the history (410), or newer than the answering API
                    # server's watch cache has: asking again would get the same answer. So list the
                    # newest, a quorum read, as the reflector's isLastSyncResourceVersionUnavailable.
                    log.debug("DRA: listing %s: %s; listing the newest", what, error)
                    list_at = ""
                    items, version = await list_from("")
                replace(items, version)
                list_at = None
                if answered is not None:  # the outage the supervisor began to say: it says the end, once
                    answered, failing = answered(), False  # (answered() is None)
            opened, brought = trio.current_time(), False
            with trio.CancelScope() as quiet:
                quiet.deadline = trio.current_time() + jittered(DRA_WATCH_QUIET_SECONDS)
                async with contextlib.aclosing(watch_from(version)) as events:
                    async for kind, item in events:
                        quiet.deadline = trio.current_time() + jittered(DRA_WATCH_QUIET_SECONDS)
                        version = str(item.get("metadata", {}).get("resourceVersion") or version)
                        update(kind, item)
                        # The backoff ends when a watch brings something, not when a list works: a
                        # watch that fails right after each list would otherwise list again and again.
                        brought, expired, delay = True, 0, DRA_WATCH_BACKOFF[0]
                        if failing:  # one line when the server fails, one when it answers again
                            log.info("DRA: watching %s: the API server answers again", what)
                            failing = False
            expired = 0
            if quiet.cancelled_caught:
                log.debug("DRA: watching %s: nothing, not even a bookmark, for a while; watching again", what)
            elif not brought and trio.current_time() - opened < DRA_SHORT_WATCH_SECONDS:
                raise ApiError(None, f"watch {what}: ended by the server at once, with nothing in it")
        except ApiError as error:
            if isinstance(error, WatchEventError):
                # What the lost event said is unknown, and watching again from the last version
                # would bring the same line again: list again (from the cache, at least as new as
                # what was seen), after the backoff, so that a stream mangled every time is no hot loop.
                list_at = version
            elif error.status == 410 and list_at is None:
                list_at, expired = version, expired + 1
                if expired == 1:  # routine, and nothing failed: listed again at once
                    log.debug("DRA: watching %s: %s; listing again", what, error)
                    continue
            if error.status == 403 and stop_when_forbidden:
                raise
            wait = jittered(max(delay, error.retry_after or 0.0))
            level = logging.DEBUG if failing else logging.WARNING  # said once, until the server answers
            log.log(level, "DRA: watching %s: %s; again in %.2g s", what, error, wait)
            failing = True
            await trio.sleep(wait)
            delay = min(delay * 2, DRA_WATCH_BACKOFF[1])


########################################################################################################
# 7. Orchestration: the nursery tree
#
#   serve_plugin
#   ├── KubeletWatch.run                         inotify on the device-plugin directory
#   ├── per resource:
#   │   ├── watch_devices                        inotify on the resource's directory (started
#   │   │                                        again by a reload applied in place: _Served.update)
#   │   └── serve_resource (api: device-plugin)  one generation at a time:
#   │       └── serve_grpc (socket N)            serve, register, wait for a kubelet restart
#   │                                            or our socket's deletion, stop, N + 1
#   ├── serve_dra (with `dra`)                   the DRA driver, all its resources (started once
#   │                                            every resource's devices are attached):
#   │   ├── DriverPeers.watch                    inotify on plugins_registry: the driver's other pods
#   │   ├── SlicePublisher.watch                 the node's ResourceSlices, watched on the API server
#   │   ├── SlicePublisher.publish               devices -> ResourceSlices, on every change
#   │   ├── ClaimPreparer.write_statuses         prepared claims' status.devices, after their answers
#   │   ├── _keep_serving (plugins/<driver>)     DRAPlugin: NodePrepareResources, NodeUnprepareResources;
#   │   │                                        DRAResourceHealth: NodeWatchResources
#   │   └── _keep_serving (plugins_registry)     Registration, for the kubelet's plugin watcher
#   └── configuration reloads (with `updates`)   each new configuration applied as it comes
#
# A cancel stops the children one at a time, the last started first in each nursery (_Parts), each
# within STOP_PART_TIMEOUT, then the API client and the metrics server; at debug level the log
# traces each one's stop.
########################################################################################################


async def serve_resource(
    resource: ResourceConfig,
    devices: Watched,
    kubelet: KubeletWatch,
    shape_allocation: ShapeAllocation | None = None,
    generations: Iterator[int] | None = None,
    *,
    examine: Callable[[DeviceEntry], DeviceEntry | str | None] | None = None,
    config: Watched | None = None,
    examiner: Callable[[bool], Callable[[DeviceEntry], DeviceEntry | str | None] | None] | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve and register one resource, again after every kubelet restart, until cancelled or
    until ``devices`` is RETIRED (then its streams send the empty list, and it returns).
    ``examine``, ``examiner`` and ``config`` (as reloads change it in place) are for
    device_plugin_service(). started() is called once the first socket is listening.
    ``generations`` numbers the sockets (default 1, 2, ...): a resource served again after a
    configuration change continues its numbering."""
    directory = kubelet.device_plugin_dir
    encoder = _ListEncoder(resource)  # kept across generations: a restart does not re-encode every device

    status = StreamStatus()
    lock = ResourceLock(resource.name, directory)
    # A node switched from another plugin (generic-device-plugin) may have running pods holding our
    # devices under its IDs: those are offered Unhealthy until the pods end (hold_back_foreign_holds).
    pod_resources = os.path.join(os.path.dirname(directory.rstrip("/")), POD_RESOURCES_SOCKET)
    try:
        async with trio.open_nursery() as holding:
            offered = await holding.start(hold_back_foreign_holds, resource, devices, pod_resources)

            def services(ending: trio.Event) -> list[purerpc.Service]:
                plugin = device_plugin_service(
                    resource,
                    offered,
                    shape_allocation,
                    encoder,
                    ending,
                    examine,
                    status,
                    config=config,
                    examiner=examiner,
                )
                return [plugin, status_service(functools.partial(status.message, resource.name))]

            with _health_check(resource.name, functools.partial(status.problem, kubelet)):
                await _serve_generations(resource, offered, kubelet, lock, services, status, generations, task_status)
            holding.cancel_scope.cancel()
    finally:
        lock.release()


async def _serve_generations(
    resource: ResourceConfig,
    devices: Watched,
    kubelet: KubeletWatch,
    lock: ResourceLock,
    services: Callable[[trio.Event], list[purerpc.Service]],
    status: StreamStatus,
    generations: Iterator[int] | None,
    task_status: trio.TaskStatus[None],
) -> None:
    """Socket N served, registered and kept until the kubelet restarts or it is deleted; then N + 1."""
    directory = kubelet.device_plugin_dir
    works = _works_later(task_status)  # started again, it works once the kubelet has accepted Register
    for generation in generations or itertools.count(1):
        if devices.value is RETIRED:
            return  # removed from the configuration while not registered: nothing to say goodbye to
        seen = await _wait_for_directory(resource, kubelet)
        if not lock.held():
            try:
                lock.acquire()  # before the first socket, and again if the directory was made anew
            except GopherplugError:
                if _identity(directory) == seen:
                    raise  # the same directory as a moment ago: a real reason (permissions, a holder)
                continue  # the directory went (or was replaced) since we looked: wait for it again
        endpoint = socket_name(resource.name, directory, generation)
        ending = trio.Event()
        async with trio.open_nursery() as nursery:
            try:
                server = await nursery.start(serve_grpc, os.path.join(directory, endpoint), services(ending))
            except FileNotFoundError:
                continue  # the directory vanished between the check and bind(): wait for it again
            except OSError as error:
                raise GopherplugError(f"{resource.name}: cannot serve on {directory}: {_describe(error)}") from None
            task_status.started()

            # The kubelet dials us back before Register returns: we are serving already.
            def still_serving(server: GRPCServer = server) -> bool:
                return server.owns_socket_file() and devices.value is not RETIRED

            status.new_kubelet()
            status.server = server
            registered_with = await register(resource, endpoint, kubelet, still_serving, devices)
            status.registered, status.registered_with = registered_with is not None, registered_with
            if registered_with is None and devices.value is RETIRED:
                nursery.cancel_scope.cancel()
                return
            if registered_with is not None:
                _log(resource).info("registered with the kubelet as %s", endpoint)
                if works is not None:
                    works()
                if _metrics is not None:
                    _metrics.registrations.labels(resource.name).inc()
                while kubelet.generation == registered_with and server.owns_socket_file() and not status.stream_failed:
                    if devices.value is RETIRED:
                        # The streams are sending the empty list and ending; let that reach the kubelet.
                        with trio.move_on_after(RETIRE_GRACE):
                            while server.live_calls:
                                await server.calls_ended.wait_touched()
                            await server.drained()
                        _log(resource).info("removed from the configuration: stopped")
                        nursery.cancel_scope.cancel()  # the server, whose socket goes with it
                        return
                    await _any_touched(kubelet.changed, devices)
            why = "our socket was deleted" if not server.owns_socket_file() else "the kubelet restarted"
            why = "a ListAndWatch stream failed" if status.stream_failed else why
            _log(resource).info("%s: serving and registering again", why)
            if registered_with is not None:
                # The kubelet that has this registration must be done with it before the next
                # Register. When a ListAndWatch stream ends, the kubelet disconnects whichever
                # plugin is registered under the resource's *name* at that moment (runClient in
                # kubernetes/kubernetes pkg/kubelet/cm/devicemanager/plugin/v1beta1/handler.go):
                # had we registered again already, the new registration would be the one dropped.
                # So the stream ends first, and we wait for the kubelet to close its connection
                # (after a kubelet restart too: the old one may still be alive).
                ending.set()
                devices.touch()
                if server.connections:
                    _log(resource).debug("waiting for the kubelet to let %s go", endpoint)
                with trio.move_on_after(RETIRE_GRACE):
                    while server.connections:
                        await server.calls_ended.wait_touched()
            nursery.cancel_scope.cancel()
        task_status = trio.TASK_STATUS_IGNORED


async def _wait_for_directory(resource: ResourceConfig, kubelet: KubeletWatch) -> tuple[int, int, int] | None:
    """Return once the kubelet's directory exists, with its identity then (see _identity).

    On a host the kubelet makes it anew when it starts, and KubeletWatch sees it come back. Inside
    a container whose hostPath mount holds the deleted directory, it never comes back: that raises
    GopherplugError (the container must be restarted to see the new one).
    """
    directory = kubelet.device_plugin_dir
    logged = False
    while True:
        try:
            links: int | None = os.stat(directory).st_nlink
        except OSError:
            links = None
        problem = deleted_directory_problem(directory, links, _read_text("/proc/self/mountinfo") or "")
        if problem is not None:
            raise RestartNeeded(problem)
        seen = _identity(directory)
        if links is not None and os.path.isdir(directory):
            return seen
        if not logged:
            _log(resource).warning("waiting for the kubelet's directory %s to exist", directory)
            logged = True
        await kubelet.changed.wait_touched()


def resource_config(name: str, **options: Any) -> ResourceConfig:
    """A validated ResourceConfig for devices that come from your program instead of a directory.

    ``options`` are the configuration file's resource keys that do not describe directory entries:
    env, replicas, preferred, annotations, pre_start, pre_start_timeout, attributes, capacity and
    describe (``attributes={"model": "H200"}``). Your DeviceEntry objects carry their own
    device_specs and mounts, and may carry attributes and capacity of their own. Raises ConfigError
    like a configuration file would."""
    source = f"resource_config({name!r})"
    about_entries = {"directory", "pattern", "match", "id_pattern", "usb", "device_specs", "mounts"}
    unfit = sorted(options.keys() & {*about_entries, "allowed_host_paths", "cdi"})
    if unfit:
        raise ConfigError(source, unfit[0], "is about a directory's entries: give each DeviceEntry what it needs")
    # The directory is never scanned: serve_devices() takes the devices from the caller.
    return _parse_resource({"name": name, "directory": "/", **options}, source, "")


async def serve_devices(
    resource: ResourceConfig,
    devices: Watched,
    device_plugin_dir: str | None = None,
    shape_allocation: ShapeAllocation | None = None,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve devices that your program supplies, until cancelled: the library entry point for them.

    ``devices`` holds a dict of device ID -> DeviceEntry: ``devices.set(...)`` whenever they change,
    and the kubelet hears of it at once. ``shape_allocation``, if given, may add to each container's
    Allocate answer. Registration, kubelet restarts and socket cleanup work as in serve_plugin().
    ``device_plugin_dir`` None: find_device_plugin_dir().

    The devices are checked as a directory's entries are (_checked_devices): a bad ID, a key that is
    not its entry's ``id``, or a value that is not a DeviceEntry is skipped with one warning.
    """
    _embedding_guard("serve_devices", devices, device_plugin_dir)
    kubelet = KubeletWatch(device_plugin_dir or find_device_plugin_dir())
    warned: dict[str, str] = {}  # skipped key -> why, as last warned
    given = devices.value
    checked = Watched(_checked_devices(resource, given, warned))
    _log_health_changes(resource, {}, checked.value, checked.value)  # those unhealthy from the start
    async with trio.open_nursery() as nursery:
        await nursery.start(kubelet.run)
        nursery.start_soon(_follow_given_devices, resource, devices, given, checked, warned)
        await nursery.start(serve_resource, resource, checked, kubelet, shape_allocation)
        task_status.started()


def _embedding_guard(function: str, devices: Any, device_plugin_dir: str | None = None) -> None:
    """Refuse, in one line, what an embedding program can get wrong before anything is served: a
    plain dict would fail deep inside, a relative directory would wait for kubelet.sock forever, and
    a call from asyncio would fail inside trio ('RunContext' object has no attribute 'runner')."""
    try:
        trio.lowlevel.current_task()
    except RuntimeError:
        raise RuntimeError(
            f"{function} runs under trio, not this event loop: from asyncio, run it in trio's guest mode "
            "(trio.lowlevel.start_guest_run), as examples/embedding/asyncio_host.py does"
        ) from None
    if not isinstance(devices, Watched):
        raise TypeError(
            f"{function}: devices must be a gopherplug.Watched holding a dict of device ID -> DeviceEntry, "
            f"not a {type(devices).__name__}: pass Watched({{...}}) and call its .set() when the devices change"
        )
    if device_plugin_dir is not None and not os.path.isabs(device_plugin_dir):
        raise ValueError(
            f"{function}: device_plugin_dir {device_plugin_dir!r} must be an absolute path (the kubelet's, "
            "e.g. /var/lib/kubelet/device-plugins)"
        )


def _checked_devices(resource: ResourceConfig, given: Any, warned: dict[str, str]) -> dict[str, DeviceEntry]:
    """The devices of ``given`` (an embedding program's dict of ID -> DeviceEntry) that the kubelet
    can be sent, each skipped one warned about once (_warn_skipped_now), as scan_directory's are.
    The kubelet checks none of it: an ID with "::" would be taken for a replica of another device,
    and a key that is not its entry's ID makes Allocate answer for another device."""
    found: dict[str, DeviceEntry] = {}
    skipped: list[tuple[str, str]] = []
    if not isinstance(given, Mapping):
        _log(resource).warning("devices: %r is not a dict of device ID -> DeviceEntry: no devices", given)
        return found
    for key, entry in given.items():
        if why := _given_device_problem(resource, key, entry):
            skipped.append((repr(key) if not isinstance(key, str) else key, why))
        else:
            found[key] = entry
    _warn_skipped_now(resource, warned, skipped)
    return found


def _given_device_problem(resource: ResourceConfig, key: Any, entry: Any) -> str:
    """Why a device an embedding program gives (``key`` -> ``entry``) cannot be served, or "": a
    DeviceEntry under its own ID, an ID that passes a directory entry's checks (_id_problem)."""
    if not isinstance(entry, DeviceEntry):
        return f"{type(entry).__name__} is not a DeviceEntry"
    if not isinstance(key, str) or key != entry.id:
        return f"the key must be its DeviceEntry's id, {entry.id!r}"
    return _id_problem(resource, key)


async def _follow_given_devices(
    resource: ResourceConfig, devices: Watched, seen: Any, checked: Watched, warned: dict[str, str]
) -> None:
    """Check each new value the program sets, publish what may be sent, and log health changes."""
    while True:
        seen = await devices.wait_changed(seen)
        now = _checked_devices(resource, seen, warned)
        before = checked.value
        _log_health_changes(resource, before, now, now.keys())
        checked.set(now)


async def serve_dra_devices(
    resource: ResourceConfig,
    devices: Watched,
    *,
    driver: str,
    node_name: str | None = None,
    api: Any = None,
    kubeconfig: str | None = None,
    kubelet_dir: str = DEFAULT_KUBELET_DIR,
    cdi_dir: str | None = None,
    cdi_kind: str | None = None,
    unhealthy_taint: str = "NoSchedule",
    pod_uid: str = "",
    device_metadata: bool = True,
    task_status: trio.TaskStatus[DraDriver] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve devices that your program supplies through DRA, as the driver ``driver``, until
    cancelled: serve_devices' counterpart, on the same ``resource`` (resource_config()) and the same
    ``devices`` (a Watched dict of device ID -> DeviceEntry, set() whenever they change).

    It is serve_dra, as a configuration file's ``dra:`` section runs it (docs/embedding.md,
    "Serving them through DRA"). The keywords are that section's (``driver``, ``kubelet_dir``,
    ``unhealthy_taint``, ``device_metadata``) and the resource's ``cdi`` (``cdi_dir``, ``cdi_kind``),
    with the same defaults; ``node_name`` defaults to NODE_NAME (the pool's name and the slices'
    owner), ``pod_uid`` is DraConfig.pod_uid. ``api``: an API client (KubeApi, or a stand-in with
    its methods), yours to close once this has returned; default KubeApi.connect(kubeconfig=
    ``kubeconfig``).

    A device reaches DRA only if its ID passes a directory entry's checks, its key is its
    DeviceEntry's ID, and its container paths need no more than {id} and {path} (a CDI device is
    described once, not per allocation): any other is skipped, with a warning. The device-plugin
    options (preferred, annotations, pre_start) are refused. Every problem with the arguments
    raises ConfigError before anything starts. started() is called with the DraDriver once its
    sockets listen."""
    _embedding_guard("serve_dra_devices", devices)
    config, dra_resource, node = _embedded_dra(
        resource, driver, node_name, kubelet_dir, cdi_dir, cdi_kind, unhealthy_taint, pod_uid, device_metadata
    )
    resources = DraResources(config.driver, node, unhealthy_taint=config.unhealthy_taint)
    offered = Watched({})  # the devices that passed the checks, their CDI spec written
    async with AsyncExitStack() as stack, trio.open_nursery() as nursery:
        if api is None:
            api = KubeApi.connect(kubeconfig=kubeconfig, node_name=node)
            stack.push_async_callback(_stop_part, "API client", api.aclose)
        # Stopped the last started first, as serve_plugin's: the driver, the devices, the API client.
        parts = _Parts(nursery)
        try:
            await parts.start(dra_resource.name, _offer_devices, dra_resource, devices, offered, resources.cdi_turn)
            # Attached before serve_dra starts: its first pass compares the slices with the pool.
            resources.attach(dra_resource, offered)
            served = await parts.start("DRA driver", serve_dra, config, resources, api, bound=2 * STOP_PART_TIMEOUT)
            task_status.started(served)
            await trio.sleep_forever()
        finally:
            await parts.stop()
            await stack.aclose()


def _embedded_dra(
    resource: ResourceConfig,
    driver: str,
    node_name: str | None,
    kubelet_dir: str,
    cdi_dir: str | None,
    cdi_kind: str | None,
    unhealthy_taint: str,
    pod_uid: str,
    device_metadata: bool = True,
) -> tuple[DraConfig, ResourceConfig, str]:
    """serve_dra_devices' arguments as a configuration file would have them: its DraConfig, the
    resource with api: dra, and the node's name; checked by the file's own parsers, so that each
    mistake is the file's one line, naming the keyword instead of the key."""
    source = f"serve_dra_devices({resource.name!r})"
    if not isinstance(driver, str):
        raise ConfigError(source, "driver", f"{driver!r}: must be the driver's name, e.g. gopherplug.example.com")
    given = dict(
        driver=driver, kubelet_dir=kubelet_dir, unhealthy_taint=unhealthy_taint, device_metadata=device_metadata
    )
    config = _parse_dra(given, source, "")
    config = with_pod_uid(Config((), dra=config), pod_uid, f"{source}: pod_uid").dra or config
    node = node_name if node_name is not None else os.environ.get("NODE_NAME", "")
    if not node:
        problem = "is required: this node's name (default: NODE_NAME, in a DaemonSet from the downward API: "
        raise ConfigError(source, "node_name", problem + "valueFrom.fieldRef.fieldPath: spec.nodeName)")
    if not isinstance(node, str) or not _DNS_SUBDOMAIN.fullmatch(node) or len(node) > _DNS_SUBDOMAIN_LENGTH:
        raise ConfigError(source, "node_name", f"{node!r} is not a node's name (a lower-case DNS subdomain)")
    # The resource as a file's resource with api: dra: name, env and replicas are DRA's too; the
    # device-plugin options are passed on only when set, for _parse_resource to refuse them with
    # what DRA has instead.
    cdi = {"kind": cdi_kind if cdi_kind is not None else dra_cdi_kind(config.driver, resource.name)}
    if cdi_dir is not None:
        cdi["spec_dir"] = cdi_dir
    entry: dict[str, Any] = {
        "name": resource.name,
        "directory": "/",  # never scanned, as resource_config's
        "env": resource.env,
        "replicas": resource.replicas,
        "api": "dra",
        "cdi": cdi,
    }
    defaults = {field.name: field.default for field in dataclasses.fields(ResourceConfig)}
    for key, value in (
        ("preferred", resource.preferred),
        ("annotations", dict(resource.annotations)),
        ("pre_start", list(resource.pre_start)),
        ("pre_start_timeout", resource.pre_start_timeout),
    ):
        if getattr(resource, key) != defaults[key]:
            entry[key] = value
    try:
        parsed = _parse_resource(entry, source, "", dra=config)
    except ConfigError as error:  # named by the keyword, not by the file's key
        keyword = {"cdi.kind": "cdi_kind", "cdi.spec_dir": "cdi_dir"}.get(error.key_path, error.key_path)
        raise ConfigError(source, keyword, error.problem) from None
    # No directory: the devices are the program's (origin() says so in the log). Its attributes,
    # capacity and describe, checked already by resource_config, are the resource's.
    parsed = dataclasses.replace(
        parsed, directory="", attributes=resource.attributes, capacity=resource.capacity, describe=resource.describe
    )
    return config, parsed, node


def _embedded_problem(resource: ResourceConfig, key: Any, entry: Any) -> str:
    """Why an embedding program's device cannot reach DRA, or "": serve_devices' checks
    (_given_device_problem), and container paths that a CDI spec can fill in (only {id} and {path};
    the configuration refuses {index} with cdi, and fills in {name} and {target} at the scan)."""
    if why := _given_device_problem(resource, key, entry):
        return why
    paths = [spec.container_path for spec in entry.device_specs] + [mount.container_path for mount in entry.mounts]
    for path in paths:
        try:
            path.format(id=key, path=entry.path)
        except (KeyError, IndexError, ValueError, AttributeError):
            return (
                f"container path {path!r}: a CDI device is described once, not per allocation: "
                "only {id} and {path} can be filled in"
            )
    return ""


async def _offer_devices(
    resource: ResourceConfig,
    devices: Watched,
    offered: Watched,
    turn: CDISpecTurn,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Keep ``offered`` equal to the embedding program's ``devices`` that pass _embedded_problem,
    through the _DeviceSet a directory's watch_devices has (the CDI spec written first, in this
    pod's turn). started() once the first set is offered (an unwritable CDI directory raises then)."""
    device_set = _DeviceSet(resource, offered, turn)
    warned: dict[str, str] = {}  # device ID -> why it is skipped, as last warned
    taken: dict[str, DeviceEntry] = {}  # what the device set has now

    async def take(value: Any) -> None:
        nonlocal taken
        if not isinstance(value, Mapping):
            raise GopherplugError(
                f"{resource.name}: devices must hold a dict of device ID -> DeviceEntry, not {value!r}"
            )
        wanted: dict[str, DeviceEntry] = {}
        skipped: list[tuple[str, str]] = []
        for key, entry in value.items():
            if why := _embedded_problem(resource, key, entry):
                skipped.append((str(key), why))
            else:
                wanted[key] = entry
        _warn_skipped_now(resource, warned, skipped)
        # Only what changed: the device set compares the CDI parts of these alone.
        changes: dict[_Key, DeviceEntry | None] = {(0, key): None for key in taken if key not in wanted}
        changes.update({(0, key): entry for key, entry in wanted.items() if taken.get(key) != entry})
        taken = wanted
        if changes or device_set.cdi_written is _NOT_YET:
            await device_set.update(changes)

    touched = devices.next_touch()  # before each look: a set() while it runs is not missed
    await take(devices.value)
    task_status.started()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_follow_turn, turn, device_set)
        if resource.describe:
            nursery.start_soon(_describe_devices, device_set)
        while True:
            await touched.wait()
            touched = devices.next_touch()
            await take(devices.value)


def _kubelets_directory(candidates: Iterable[str]) -> str | None:
    """The first of ``candidates`` whose kubelet.sock accepts a connection, else the first holding a
    kubelet.sock socket at all; None if none holds one."""
    sockets = []
    for directory in candidates:
        with contextlib.suppress(OSError):
            if stat.S_ISSOCK(os.stat(os.path.join(directory, KUBELET_SOCKET)).st_mode):
                sockets.append(directory)
    return next((d for d in sockets if _accepts(os.path.join(d, KUBELET_SOCKET))), sockets[0] if sockets else None)


def find_device_plugin_dir(candidates: Iterable[str] = KNOWN_DEVICE_PLUGIN_DIRS) -> str:
    """GOPHERPLUG_DEVICE_PLUGIN_DIR if set, else the kubelet's directory among ``candidates``
    (_kubelets_directory: the one listening, since a node that once ran another distribution keeps
    that kubelet's dead socket), else (with a warning) the first one."""
    if given := os.environ.get("GOPHERPLUG_DEVICE_PLUGIN_DIR"):
        # The command line's variable, read here too so that an embedding program (serve_devices,
        # serve_plugin) is pointed at a kubelet the same way, with the same checks.
        if not os.path.isabs(given):
            raise ConfigError("GOPHERPLUG_DEVICE_PLUGIN_DIR", "", f"{given!r} must be an absolute path")
        if (problem := device_plugin_dir_problem(os.path.normpath(given))) is not None:
            raise ConfigError("GOPHERPLUG_DEVICE_PLUGIN_DIR", "", problem)
        log.info("GOPHERPLUG_DEVICE_PLUGIN_DIR: the kubelet's directory is %s", os.path.normpath(given))
        return os.path.normpath(given)
    candidates = list(candidates)
    if (directory := _kubelets_directory(candidates)) is not None:
        log.info("kubelet.sock found in %s: using it (set device_plugin_dir to choose another)", directory)
        return directory
    log.warning(
        "no kubelet.sock in %s: waiting for the kubelet in %s; if this node's kubelet uses another "
        "directory, set device_plugin_dir in the configuration, --device-plugin-dir or GOPHERPLUG_DEVICE_PLUGIN_DIR",
        ", ".join(candidates),
        candidates[0],
    )
    return candidates[0]


def device_plugin_dir_mistake(directory: str, candidates: Iterable[str] = KNOWN_DEVICE_PLUGIN_DIRS) -> str | None:
    """For check-config: why ``directory``, given as the kubelet's, looks wrong, or None. serve would
    wait in it for a kubelet.sock that never comes: it does not exist (a typo), or it holds none
    while one of the known directories does. The nearest known directory is proposed."""
    candidates = list(candidates)
    if os.path.exists(os.path.join(directory, KUBELET_SOCKET)):
        return None
    elsewhere = _kubelets_directory(candidates)
    if os.path.isdir(directory) and elsewhere is None:
        return None  # no kubelet on this machine (yet): nothing to compare with
    state = "does not exist" if not os.path.isdir(directory) else "holds no kubelet.sock"
    problem = f"{directory} {state}: serve would wait there for the kubelet"
    if elsewhere is not None and elsewhere != directory:
        return f"{problem}; this machine's kubelet is in {elsewhere}"
    import difflib  # here, not at the top: only for a directory that looks mistaken

    # Not the directory given (a known one, missing here): "did you mean" the very path just said
    # to be missing would send the user round in a circle.
    others = [candidate for candidate in candidates if candidate != directory]
    if close := difflib.get_close_matches(directory, others, n=1):
        return f"{problem}; did you mean {close[0]}?"
    return problem


async def serve_plugin(
    config: Config,
    *,
    updates: Callable[[Config], AsyncGenerator[Config, None]] | None = None,
    node_name: str | None = None,
    api: Any = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the device plugin for every resource of ``config`` until cancelled.

    The library entry point: an embedding program starts it in its own nursery
    (``await nursery.start(serve_plugin, config)``) and cancels that nursery to stop it. started()
    is called once every resource's socket is listening. No signal handling here: that belongs to
    the program (see main()). With ``updates`` (given the configuration applied, a generator of the
    new ones: watch_config_file() with it as ``current``, called again if it raises), each is applied
    as it comes: added resources start, removed ones send an empty list and stop, changed ones are
    updated in place (their stream stays open and sends the new list) unless what the kubelet was
    told at registration changed (register_again() says): those are served and registered anew; the
    others are not touched.

    With ``config.dra``, it is also that DRA driver (serve_dra): ``node_name`` is this node's name
    (default: NODE_NAME), ``api`` the API server client (default: KubeApi.connect(); one of the
    caller's is the caller's to close, once this has returned).

    Sockets are removed on the way out, whatever the reason. A cancel stops the parts one at a time,
    the last started first (_Parts). Kubelet absence, restarts and refusals are logged and retried;
    only an error the plugin cannot recover from (e.g. no permission to create its socket) raises."""
    # Only once a resource uses the device-plugin API: a DRA-only pod does not even mount that
    # directory, and looking for kubelet.sock there would only warn about its absence.
    kubelet: KubeletWatch | None = None
    served: dict[str, _Served] = {}
    generations: dict[str, Iterator[int]] = {}  # socket numbers go on across a resource's restarts
    if config.dra is not None:
        node_name = node_name or os.environ.get("NODE_NAME", "")
        if not node_name:
            raise GopherplugError(
                "NODE_NAME is not set: DRA needs this node's name (in a DaemonSet, from the downward API: "
                "valueFrom.fieldRef.fieldPath: spec.nodeName)"
            )
    health = Health()
    # Every part started from here sees it (_health_check): reset on the way out, for an embedding
    # program's task that runs other things after this returns.
    health_token = _HEALTH.set(health)
    async with AsyncExitStack() as stack, trio.open_nursery() as nursery:
        stack.callback(_HEALTH.reset, health_token)
        # What the stop does after the tasks (before the nursery waits for any part left behind), in
        # the reverse order: the API client, the metrics.
        if config.metrics_address is not None:  # read at start only: a reload does not move the server
            metrics = _start_metrics(config.metrics_address)
            stack.push_async_callback(_stop_part, "metrics server", functools.partial(_stop_metrics, metrics))
            nursery.start_soon(_supervised, "metrics server", metrics.serve_http)
        # The tasks, stopped the last started first: the DRA driver, the resources, the kubelet watch;
        # before them the reloads, so that none starts a resource while the others stop.
        parts, reloads = _Parts(nursery), _Parts(nursery)

        async def watch_kubelet(wanted: Config) -> None:
            nonlocal kubelet, config
            if kubelet is None and any(resource.device_plugin for resource in wanted.resources):
                kubelet = KubeletWatch(wanted.device_plugin_dir or find_device_plugin_dir())
                await parts.start("kubelet watch", kubelet.run)
                config = dataclasses.replace(config, device_plugin_dir=wanted.device_plugin_dir)  # what now runs

        dra_resources: DraResources | None = None
        reloading = False  # at start, a resource that cannot start stops the plugin; on a reload, not
        roster = Watched(None)  # touched when a reload has changed what is served

        async def start(resource: ResourceConfig, old: _Served | None = None) -> str:  # "" or why not
            one = _Served(resource, written=old.written if old else {}, replacing=old)
            numbers = generations.setdefault(resource.name, itertools.count(1))
            try:  # not supervised whole: its directory watch and its registration are, each on its own
                part = (one, kubelet, config.sysfs_root, config.dev_root, numbers, dra_resources)
                await parts.start(resource.name, _serve_one, *part, supervise=False)
                served[resource.name] = one
                return ""
            except Exception as error:
                if not reloading or not isinstance(_innermost(error), GopherplugError):
                    raise  # at start: the plugin stops with that one line
                # On a reload, one resource that cannot start (its CDI directory unwritable, say)
                # must not take the others down.
                return str(_innermost(error))

        applied = config  # what a new watch of the configuration compares it with
        refused: tuple[Config, dict[str, str]] | None = None  # the last reload the node refused, and why

        async def reload(*, task_status: trio.TaskStatus[None]) -> None:
            nonlocal reloading, applied
            reloading = True
            assert updates is not None  # started only with them
            # A watch of its own at each run (_supervised): one that raised is finished. It reads the file
            # at once: the configuration a failed run did not apply, or a newer one, is applied.
            async with contextlib.aclosing(updates(applied)) as configs:
                # This task runs on from started() without yielding, into the first step of ``configs``.
                task_status.started()
                async for new in configs:
                    await apply(new)
                    applied = new

        async def apply(new: Config) -> None:
            """Apply ``new`` resource by resource, each whole or not at all (reload_plan says what). What the
            node refuses is tried again (NotYet): its lines at debug while the same refusal repeats."""
            nonlocal refused
            lines: list[tuple[int, str]] = []  # said at the end, once the refusals are known
            fixed: tuple[str, ...] = ("device_plugin_dir", "sysfs_root", "dev_root", "dra", "nfd_features_file")
            if kubelet is None:  # not watched yet: it will be where the reload that needs it says
                fixed = fixed[1:]
            if any(getattr(new, key) != getattr(config, key) for key in fixed):
                lines.append((logging.WARNING, f"{new.source}: {', '.join(fixed)} take effect at the next start"))
            wanted = {resource.name: resource for resource in new.resources}
            before = list(served)
            plan = reload_plan({name: one.resource for name, one in served.items()}, new, dra_resources is not None)
            done: dict[str, list[str]] = {what: [] for what in _RELOAD_SAID}
            failed: dict[str, str] = {}  # refused by the node, not by reload_plan: why
            await watch_kubelet(new)  # the first resource that uses the device-plugin API starts the watch
            for name, (action, why) in plan.items():
                if action == "stop":
                    await served.pop(name).retire()
                elif action == "refuse":
                    lines.append((logging.WARNING, f"{name}: {why}: kept as it was"))
                elif action in ("update", "again") and (why := await served[name].update(wanted[name])):
                    action = "refuse"  # its watch could not start: the old configuration goes on
                elif action == "register":
                    old = served[name]
                    old.watch_scope.cancel()  # paused, devices kept: two watches would write one CDI spec
                    await old.watch_done.wait()
                    if (why := await start(wanted[name], old)) and not old.done.is_set():
                        await old.start_watch(old.resource)  # still registered, its devices at the kubelet as they were
                    elif why:  # the new registration failed, the old one stopped: served again (if that fails too,
                        await start(served.pop(name).resource, old)  # out of ``served``, as one never started)
                    action = "refuse" if why else action
                elif action == "start" and (why := await start(wanted[name])):
                    action = "not added"
                if action != plan[name][0]:
                    failed[name] = why
                    lines.append((logging.ERROR, f"{name}: {why}: not applied, tried again"))
                done.setdefault(action, []).append(name)
            if _metrics is not None:
                # Every task of a removed (or stopped) resource has ended, its goodbye sent
                # and counted: nothing can bring its series back after this.
                for name in dict.fromkeys([*before, *wanted]):
                    pool = dra_pool_name(dra_resources.node_name, name) if dra_resources is not None else None
                    _metrics.forget(name, pool, served[name].resource if name in served else None)
            summary = ", ".join(
                f"{said} {', '.join(done[what])}{' as it was' if what == 'refuse' else ''}"
                for what, said in _RELOAD_SAID.items()
                if done[what]
            )
            lines.append((logging.INFO, f"{new.source}: configuration reloaded: {summary or 'no resource changed'}"))
            again, refused = refused == (new, failed), (new, failed) if failed else None
            for level, line in lines:
                log.log(logging.DEBUG if again else level, "%s", line)
            roster.touch()  # the resources served now: _warn_shared_nodes looks at them afresh
            if failed:  # by the node (a full CDI directory): the task's restart applies the file again
                raise NotYet(f"{', '.join(failed)}: not applied for now")

        try:
            if config.health_address is not None:  # first and stopped last: read at start only, as metrics
                await parts.start("health server", serve_health, config.health_address, health)
            await watch_kubelet(config)
            if config.dra is not None and node_name:
                if api is None:
                    api = KubeApi.connect(node_name=node_name)
                    stack.push_async_callback(_stop_part, "API client", api.aclose)
                    # Importing lightkube, httpx2 and httpcore2 (about 11 MiB that stay) also freed
                    # what their import made and dropped: 0.1 to 0.3 MiB that glibc would keep.
                    _release_freed_memory()
                dra_resources = DraResources(config.dra.driver, node_name, unhealthy_taint=config.dra.unhealthy_taint)
            for resource in config.resources:
                await start(resource)
            # Not a part: it holds nothing, and a stop cancels it at once, with the rest of the nursery.
            nursery.start_soon(_supervised, "shared device nodes", _warn_shared_nodes, served, roster)
            if config.nfd_features_file is not None:  # read at start only, as metrics_address
                nfd = config.nfd_features_file
                nursery.start_soon(_supervised, "NFD feature file", _keep_nfd_features, nfd, served, roster)
            if config.dra is not None and dra_resources is not None:
                # Only now, with every resource's devices attached: the publisher's first pass compares
                # the slices it lists with all the pools (earlier, a restarted plugin would delete its own
                # slices and write them again), and the kubelet learns of a driver whose pools exist.
                bound = 2 * STOP_PART_TIMEOUT
                await parts.start("DRA driver", serve_dra, config.dra, dra_resources, api, bound=bound)
            if updates is not None:
                # Before our started(): the first step of ``updates`` places its inotify watch and
                # reads the file, and a change made once we have started must not come before it.
                await reloads.start("configuration reloads", reload)
            task_status.started()
            await trio.sleep_forever()
        finally:
            await reloads.stop()
            await parts.stop()
            await stack.aclose()


async def _warn_shared_nodes(
    served: Mapping[str, _Served], roster: Watched, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Warn once about each device node two served resources offer (shared_nodes), as their devices
    come and go: a node plugged in later is told when it appears, and again if it comes back after
    it stopped being shared."""
    said: set[str] = set()
    while True:
        # The events before the look: a change made while looking is not missed.
        events = [watched.next_touch() for watched in (roster, *(one.devices for one in served.values()))]
        offered = [(one.resource, one.devices.value.values()) for one in served.values()]
        lines = shared_nodes(offered) if len(offered) > 1 else []
        for line in lines:
            if line not in said:
                log.warning("%s", line)
        said = set(lines)
        task_status.started()
        task_status = trio.TASK_STATUS_IGNORED
        await _any_event(events, trio.Event())


#: How long a feature file that could not be written waits to be tried again, if no change comes first.
NFD_RETRY_SECONDS = 30.0


def write_nfd_features(path: str, text: str) -> os.stat_result:
    """Write the NFD feature file whole (_replace_whole: nfd-worker reads it at every event in its
    directory, and skips the temporary file, whose name begins with "."), its directory made if
    missing; not synced to the disk: every start writes it anew. Raises OSError."""
    directory = os.path.dirname(path)
    if os.path.lexists(directory) and not os.path.isdir(directory):  # makedirs would say "File exists"
        raise NotADirectoryError(errno.ENOTDIR, f"{directory} is not a directory")
    os.makedirs(directory, mode=0o755, exist_ok=True)
    return _replace_whole(path, text, f".{os.path.basename(path)}-", 0o644, durable=False)


async def _keep_nfd_features(
    path: str,
    served: Mapping[str, _Served],
    roster: Watched,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Keep the NFD feature file ``path`` (nfd_features) as the served resources' devices and the
    configuration change: written when its text changes (off the kubelet's path). A write that fails
    is said once and tried again at the next change or after NFD_RETRY_SECONDS; the plugin serves on.

    Removed when cancelled (a clean stop), so NFD removes the labels, if it is still the file this
    task wrote (its inode): in a DaemonSet's rolling update with surge the new pod's stays. If the
    old pod wrote it last (its devices changed) and removes it, the new pod sees it vanish (inotify)
    and writes it again."""
    text: str | None = None
    written: os.stat_result | None = None
    failing: str | None = None
    vanished = Watched(None)

    async def watch_file(watch: DirectoryWatch) -> None:
        async with contextlib.aclosing(watch.batches()) as batches:
            async for _ in batches:
                vanished.touch()  # the loop looks whether it was the file

    try:
        with DirectoryWatch(os.path.dirname(path), flags.DELETE | flags.MOVED_FROM) as watch:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch_file, watch)
                while True:
                    # The events before the look: a change made while looking is not missed.
                    wakes = (roster, vanished, *(one.devices for one in served.values()))
                    events = [watched.next_touch() for watched in wakes]
                    if text is not None and not os.path.lexists(path):
                        text = None  # another pod's stop removed it: written again
                    wanted = nfd_features(
                        (one.resource, one.devices.value) for one in served.values() if one.devices.value is not RETIRED
                    )
                    if wanted != text:
                        try:
                            written = await trio.to_thread.run_sync(write_nfd_features, path, wanted)
                        except OSError as error:
                            problem = (
                                f"cannot write the NFD feature file {path} (nfd_features_file): {_describe(error)}:"
                                " its labels stay as they were; trying again at the next change or in "
                                f"{NFD_RETRY_SECONDS:g} s"
                            )
                            if problem != failing:
                                log.error("%s", problem)
                            failing = problem
                        else:
                            text = wanted
                            if failing is not None:
                                log.info("wrote the NFD feature file %s again", path)
                            failing = None
                            if len(wanted.encode()) > NFD_MAX_FEATURE_FILE_SIZE:
                                log.error(
                                    "the NFD feature file %s has %d bytes: NFD skips a file over %d bytes whole, so "
                                    "none of its labels reach the node; serve fewer resources from this configuration",
                                    path,
                                    len(wanted.encode()),
                                    NFD_MAX_FEATURE_FILE_SIZE,
                                )
                    task_status.started()
                    task_status = trio.TASK_STATUS_IGNORED
                    with trio.move_on_after(NFD_RETRY_SECONDS if failing is not None else math.inf):
                        await _any_event(events, trio.Event())
    finally:
        if written is not None:
            with contextlib.suppress(OSError):
                now = os.stat(path)
                if (now.st_dev, now.st_ino) == (written.st_dev, written.st_ino):
                    os.unlink(path)


def _start_metrics(address: str) -> Metrics:
    global _metrics  # the hooks read it: passing it down would touch every caller
    if _metrics is not None:
        raise GopherplugError("metrics are served already: one plugin with metrics_address per process")
    _metrics = Metrics(address)
    host = address.rpartition(":")[0]
    log.info("serving Prometheus metrics on http://%s:%d/metrics", host, _metrics.port)
    return _metrics


async def _stop_metrics(metrics: Metrics) -> None:
    global _metrics
    _metrics = None
    metrics.close()  # its serve_http task ends, closing the port


# What a reload does to a resource (reload_plan), as the log's summary says it.
_RELOAD_SAID = {
    "start": "added",
    "update": "updated in place",
    "again": "described again",
    "register": "re-registered",
    "stop": "removed",
    "refuse": "kept",
    "not added": "did not add",
}


def reload_plan(running: Mapping[str, ResourceConfig], new: Config, dra: bool) -> dict[str, tuple[str, str]]:
    """What a reload from the ``running`` resources (by name) to ``new`` does to each, ``dra`` telling
    whether the DRA driver runs: by name, (action, why). "keep" (unchanged), "again" (unchanged, its
    describe run again: what it says may have changed with no device coming or going), "update" (in
    place, its stream left open), "register" (served and registered anew: register_again), "start",
    "stop", or "refuse" with why: the change waits for a restart, and the resource serves on as it was."""
    wanted = {resource.name: resource for resource in new.resources}
    plan = {name: ("stop", "") for name in running if name not in wanted}
    for name, resource in wanted.items():
        old = running.get(name)
        if old is None:
            plan[name] = ("start", "")
        elif old == resource:
            plan[name] = ("again" if resource.describe else "keep", "")
        elif old.api != resource.api and resource.dra and not dra:
            why = f"api: {resource.api} takes effect at the next start (the DRA driver is not running)"
            plan[name] = ("refuse", why)
        else:  # in place where it may: a stream ended makes the kubelet reject the pods it admits meanwhile
            plan[name] = ("register" if register_again(old, resource) else "update", "")
    return plan


def register_again(old: ResourceConfig, new: ResourceConfig) -> bool:
    """Whether a reload from ``old`` to ``new`` (the same resource name) must serve and register
    the resource anew, rather than update it in place.

    Only what the kubelet was told must: it takes the options from GetDevicePluginOptions during
    Register and never asks again (pre_start_required: whether it calls PreStartContainer), and
    the api decides whether there is a registration at all. Everything else is ours: the open
    stream sends the new list, and the answers follow the new configuration from then on.
    """
    return old.api != new.api or device_plugin_options(old) != device_plugin_options(new)


@dataclass
class _Served:
    """One resource of a running configuration, and the means to update and stop it."""

    resource: ResourceConfig  #: as configured now
    devices: Watched = dataclasses.field(default_factory=lambda: Watched({}))
    scope: trio.CancelScope = dataclasses.field(default_factory=trio.CancelScope)  #: everything
    watch_scope: trio.CancelScope = dataclasses.field(default_factory=trio.CancelScope)  #: its directory watch
    done: trio.Event = dataclasses.field(default_factory=trio.Event)
    #: ``resource`` for the running device-plugin service: its answers follow an update
    config: Watched = dataclasses.field(init=False)
    #: (re)starts the directory watch for a configuration; set by _serve_one as it starts
    start_watch: Callable[[ResourceConfig], Awaitable[None]] = dataclasses.field(init=False, repr=False)
    watch_done: trio.Event = dataclasses.field(default_factory=trio.Event)
    dra_resources: DraResources | None = None
    #: what its describe last said, by device ID: kept across its watches, so that a reload's new
    #: watch publishes the devices as described until describe has run again
    described: dict[str, ReadValues] = dataclasses.field(default_factory=dict)
    #: the CDI spec its watches last wrote, by file (watch_devices)
    written: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: on a reload that registers anew (register_again), the one it stops once its own watch started
    replacing: _Served | None = None

    def __post_init__(self) -> None:
        self.config = Watched(self.resource)

    async def update(self, new: ResourceConfig) -> str:
        """Apply a configuration with the same name and options, the stream left open. Returns ""
        or why not (its watch could not start: the old configuration goes on)."""
        old = self.resource
        # The directory watch starts afresh: sources, templates or the CDI kind may differ. The
        # devices stay published meanwhile; the new watch writes the CDI spec before replacing
        # them. The old spec stays: the kubelet keeps the CDI names of allocations made with it.
        self.watch_scope.cancel()
        await self.watch_done.wait()
        try:
            await self.start_watch(new)
        except Exception as error:
            if not isinstance(_innermost(error), GopherplugError):
                raise
            await self.start_watch(old)
            return str(_innermost(error))
        # Only now, the new CDI spec written: Allocate may name the new kind's devices.
        self.resource = new
        self.config.replace(new)  # the service's answers from now on (env, device specs, replicas...)
        if new.replicas != old.replicas:
            # Other IDs for the same devices: the open stream sends the list again at once. Until
            # the kubelet has it, an Allocate for an ID of the old list is refused (milliseconds).
            self.devices.replace(dict(self.devices.value))
        if new.dra and self.dra_resources is not None:
            # The pool's slices are compared and written again with the new configuration; the
            # claims prepared until now keep their checkpointed answers.
            self.dra_resources.attach(new, self.devices)
        return ""

    async def retire(self) -> None:
        """Removed from the configuration: stop watching, send the kubelet an empty list, stop."""
        self.watch_scope.cancel()
        self.devices.replace(RETIRED)
        with trio.move_on_after(RETIRE_GRACE * 2):  # serve_resource returns by itself within RETIRE_GRACE
            await self.done.wait()
        await self.stop()

    async def stop(self) -> None:
        """Stop at once: the stream ends, the socket goes; the kubelet marks the devices unhealthy."""
        self.scope.cancel()
        await self.done.wait()


async def _serve_one(
    served: _Served,
    kubelet: KubeletWatch | None,
    sysfs_root: str,
    dev_root: str,
    generations: Iterator[int],
    dra_resources: DraResources | None = None,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    resource = served.resource
    try:
        with served.scope:
            async with trio.open_nursery() as nursery:

                async def watch(
                    resource: ResourceConfig,
                    scope: trio.CancelScope,
                    done: trio.Event,
                    *,
                    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
                ) -> None:
                    try:
                        with scope:
                            turn = dra_resources.cdi_turn if dra_resources is not None else None
                            await _supervised(
                                f"{resource.name}: directory watch",
                                functools.partial(watch_devices, described=served.described, written=served.written),
                                resource,
                                served.devices,
                                sysfs_root,
                                dev_root,
                                turn,
                                task_status=task_status,
                            )
                    finally:
                        done.set()

                async def start_watch(resource: ResourceConfig) -> None:
                    served.watch_scope, served.watch_done = trio.CancelScope(), trio.Event()
                    await nursery.start(watch, resource, served.watch_scope, served.watch_done)

                served.start_watch = start_watch
                served.dra_resources = dra_resources
                if _metrics is not None:  # before the first scan: a resource with no device has its 0
                    pool = dra_pool_name(dra_resources.node_name, resource.name) if dra_resources is not None else None
                    _metrics.serve(resource, pool if resource.dra else None)
                await start_watch(resource)
                if resource.dra:
                    if dra_resources is None:
                        _log(resource).error(
                            "api: %s takes effect at the next start (the DRA driver is not running)", resource.api
                        )
                    else:
                        dra_resources.attach(resource, served.devices)
                if served.replacing is not None:
                    # Only now: a change the node refuses (an unwritable CDI directory) has left the old
                    # registration, its streams and its devices at the kubelet as they were. The
                    # kubelet takes one registration per resource name: the old one goes first.
                    await served.replacing.stop()
                    served.replacing = None
                if resource.device_plugin:
                    assert kubelet is not None  # serve_plugin watches it before such a resource starts

                    def examiner(off_loop: bool) -> Callable[[DeviceEntry], DeviceEntry | str | None] | None:
                        # Once per Allocate: the configuration as reloaded, its roots resolved now (a directory
                        # may be a symlink re-pointed since the scan). On the event loop only if each path is in
                        # dev_root (devtmpfs: the kernel answers from memory, never a server); else _found_now's.
                        current = served.config.value
                        paths = [*(source.directory for source in current.sources), *current.allowed_host_paths]
                        if not off_loop and not all(_is_under(path, [dev_root]) for path in paths):
                            return None
                        directories: dict[str, str] = {}
                        roots = host_path_roots(current, dev_root, directories)
                        return lambda device: examine_again(current, device, roots, sysfs_root, directories)

                    serve = functools.partial(serve_resource, examiner=examiner, config=served.config)
                    registration = f"{resource.name}: registration"
                    await nursery.start(
                        _supervised, registration, serve, resource, served.devices, kubelet, None, generations
                    )
                task_status.started()
                if not resource.device_plugin:
                    while served.devices.value is not RETIRED:  # then the pool empties, and we are done
                        await served.devices.wait_touched()
                    nursery.cancel_scope.cancel()
    finally:
        if dra_resources is not None and dra_resources.served.get(resource.name, (None, None))[1] is served.devices:
            dra_resources.detach(resource.name)
        served.done.set()


async def watch_config_file(
    path: str,
    device_plugin_dir: str | None = None,
    current: Config | None = None,
    device_plugin_dir_from: str = "--device-plugin-dir",
    on_watch: Callable[[DirectoryWatch], None] | None = None,
    metrics_address: str | None = None,
) -> AsyncGenerator[Config, None]:
    """Yield the configuration each time the file changes to a new valid one, until closed.

    inotify on the file's directory sees it written in place (IN_CLOSE_WRITE), replaced by a
    rename (editors, mv) and swapped the way a ConfigMap volume does it (a "..data" symlink renamed
    over); where the file's symlinks lead is followed too. An invalid file (or one a bug meets,
    _held_back) is logged with its error, and the running configuration stays; the next valid
    reading is logged as valid again. With ``current`` (running now), the file is compared with it
    first: an edit made during the start is not lost. ``on_watch`` is given the watch: its poke()
    has the file read again now (SIGHUP). ``metrics_address`` and ``device_plugin_dir`` (the
    command line's) override the file's in every reading, as the running configuration has them."""
    directory = os.path.dirname(os.path.abspath(path))
    with DirectoryWatch(directory, _DIRECTORY_EVENTS | flags.CLOSE_WRITE, follow_mask=flags.CLOSE_WRITE) as watch:
        if on_watch is not None:
            on_watch(watch)
        last_text, last_config = (None, current) if current is not None else (_read_text(path), None)
        look_now = current is not None
        unread = ""  # why the file could not be read, while it cannot (out of descriptors, a hung read)
        invalid: ConfigError | None = None  # the error of the file as last read, while it is invalid
        held: str | None = None  # the text of a file held back as emptying a resource (_emptied), until SIGHUP
        last_read = last_text  # without ``current``: the file as first read, what the caller runs
        async with contextlib.aclosing(watch.batches()) as batches:
            while True:
                watch.follow(_symlink_hops(path) if os.path.islink(path) else ())
                if not look_now:
                    await batches.__anext__()
                look_now = False
                try:  # off the event loop: the file's volume (a dead NFS mount, say) may never answer
                    text = await trio.to_thread.run_sync(_within, functools.partial(_file_text, path))
                except FileNotFoundError:
                    text = None  # gone for a moment (being replaced): the next event reads it again
                except OSError as error:  # what the file says now is not known: the change waits, not lost
                    if _describe(error) != unread:
                        unread = _describe(error)
                        log.warning("cannot read %s: %s; keeping the running configuration, trying again", path, unread)
                    watch.again(INOTIFY_RETRY_INTERVAL)
                    continue
                unread = ""
                # SIGHUP on a held-back file that did not change since: apply it as it is, as asked.
                forced = held is not None and text == held and watch.poked
                if text is None or (text == last_text and not forced):
                    if watch.poked:  # asked for: say that there was nothing to do, or the asker wonders
                        if text is None:
                            log.warning("cannot read %s", path)
                        elif invalid is not None:  # "unchanged" would read as all is well
                            log.error("%s; keeping the running configuration", invalid)
                        else:
                            log.info("%s unchanged", path)
                    continue
                last_text = text
                try:
                    with _held_back("config", "", lambda line: ConfigError(path, "", line), logger=None):
                        config = _config_from_text(text, path, device_plugin_dir, device_plugin_dir_from)
                        if metrics_address is not None:
                            config = dataclasses.replace(config, metrics_address=metrics_address)
                        emptied = (
                            config != last_config
                            and config.warnings
                            and not forced
                            and await _emptied(last_config or _config_or_none(last_read, path), config)
                        )
                except ConfigError as error:
                    log.error("%s; keeping the running configuration", error)
                    invalid = error
                    continue
                if invalid is not None:
                    # The ERROR logged for the file must not stay the last word on it: say that it
                    # is fixed; the reload's own line, which follows, says what was applied.
                    invalid = None
                    if config == last_config:
                        log.info("%s is valid again, the same as the running configuration: nothing to apply", path)
                    else:
                        log.info("%s is valid again: applying it", path)
                held = None
                if emptied:
                    # A DaemonSet's ConfigMap reaches every node at once: a warned-about file that would
                    # take a served resource to nothing is taken for a mistake until it is confirmed.
                    held = text
                    log.error(
                        "%s: held back, keeping the running configuration: %s; fix the file, or send the plugin "
                        "SIGHUP to apply it as it is",
                        path,
                        emptied,
                    )
                    continue
                if config != last_config:
                    last_config = config
                    for warning in config.warnings:
                        log.warning("%s", warning)
                    yield config


def _config_or_none(text: str | None, path: str) -> Config | None:
    """The configuration in ``text``, or None when there is none or it is invalid."""
    try:
        return parse_config(text, path) if text is not None else None
    except ConfigError:
        return None


async def _emptied(running: Config | None, new: Config) -> str:
    """Why ``new`` looks like a mistake that would empty a live resource, or "": one of its resources
    is warned about (check-config's warnings: a regex-looking pattern) and, as ``new`` describes it,
    finds no device on this node, while the same resource of ``running`` finds some. Scans only
    then (a warning is rare): the directory as it is now, for both, off the event loop by a deadline
    (a scan's sysfs read may hang): a scan late is a reason to hold ``new`` back too."""
    if running is None or not new.warnings:
        return ""
    before = {resource.name: resource for resource in running.resources}
    for index, resource in enumerate(new.resources):
        warned = [w for w in new.warnings if f": resources[{index}]." in w and ".pattern: " in w]
        old = before.get(resource.name)
        if not warned or old is None or old == resource:
            continue
        said = f"resources[{index}].{warned[0].partition(f'resources[{index}].')[2]}"
        scans = [(old, running), (resource, new)]
        try:
            count, left = await trio.to_thread.run_sync(
                _within,
                lambda s=scans: [len(scan_directory(r, c.sysfs_root, c.dev_root).devices) for r, c in s],
                abandon_on_cancel=True,
            )
        except TimeoutError:
            return f"{resource.name}'s scan has not returned in {FILE_READ_TIMEOUT:g} s, and {said}"
        if count and not left:
            return f"{resource.name} would go from {_devices(count)} to none, and {said}"
    return ""


########################################################################################################
# 8. A kubelet simulator
#
# The kubelet's device manager, reduced to what a plugin can observe (see docs/protocol.md):
# it wipes the sockets of its directory on start, serves Registration on kubelet.sock, validates
# Register and dials the plugin back *before* answering, keeps one ListAndWatch stream per
# resource, marks every device unhealthy when that stream ends, and calls Allocate and
# GetPreferredAllocation on demand, refusing them as the kubelet does while no device is healthy
# (the pods it would reject are recorded). It makes its directory anew when it is removed.
# The demo runs it; gopherplug's own tests use it (gopherplug_standins names it with the others),
# and so can a plugin author's.
#
# Only what the product and its demo need is here. A node runs this file and a learner reads it:
# the stand-ins that serve tests alone (the API server's validation, its failures on demand, the
# scheduler with its CEL) live beside the tests in gopherplug_standins.py, never in an image.
########################################################################################################

#: How long the kubelet waits to dial a registering plugin back.
KUBELET_DIAL_TIMEOUT = 10.0


@dataclass
class SimulatedResource:
    """What the simulated kubelet knows of one registered resource."""

    endpoint: str  #: the socket file name the plugin registered
    options: Any  #: what GetDevicePluginOptions answered during Register
    devices: dict[str, str]  #: device ID -> health, from the latest ListAndWatch message
    topology: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)  #: device ID -> NUMA nodes
    updates: int = 0  #: ListAndWatch messages received since this registration
    streaming: bool = False  #: whether the ListAndWatch stream is open
    stream: trio.CancelScope = dataclasses.field(default_factory=trio.CancelScope, repr=False)  #: cancel: disconnect

    @property
    def capacity(self) -> int:
        """Node capacity for the resource: every device."""
        return len(self.devices)

    @property
    def allocatable(self) -> int:
        """Node allocatable for the resource: the healthy devices."""
        return sum(health == HEALTHY for health in self.devices.values())


class KubeletSimulator:
    """A stand-in for the kubelet's device manager on a directory of your choice.

    Run it with ``await nursery.start(simulator.run)``; ``restart()`` behaves like a kubelet restart;
    ``wait_until(predicate)`` waits (without polling) until ``predicate(simulator)`` holds."""

    def __init__(self, device_plugin_dir: str) -> None:
        self.device_plugin_dir = device_plugin_dir
        self.socket_path = os.path.join(device_plugin_dir, KUBELET_SOCKET)
        self.resources: dict[str, SimulatedResource] = {}  #: by resource name
        self.registrations: list[Any] = []  #: every accepted RegisterRequest, in order
        #: for each of ``registrations``, the start of the kubelet that accepted it (1 for the first):
        #: a kubelet instance must get exactly one registration per resource from a plugin that keeps serving
        self.registered_in: list[int] = []
        self.refusals: list[str] = []  #: the error of every refused Register, in order
        self.starts = 0  #: how many times the simulated kubelet started
        #: What happened, in order: ("registered" | "stream ended" | "disconnected", resource, endpoint)
        self.events: list[tuple[str, str, str]] = []
        #: (resource, message) of every allocation refused because none of the resource's devices
        #: was healthy: a pod the real kubelet would have rejected for good. A plugin that keeps its
        #: stream open across a reload never causes one.
        self.rejections: list[tuple[str, str]] = []
        #: (namespace, pod) -> container -> resource -> the device IDs allocated to it: the device
        #: manager's podDevices, what PodResources List reports (allocate(..., container=...))
        self.pod_devices: dict[tuple[str, str], dict[str, dict[str, list[str]]]] = {}
        self._changed = Watched(None)
        self._restart = trio.Event()
        self._remove_directory = False
        self._hold: trio.Event | None = None
        self._asked = self._done = 0  # restarts asked for; of those, carried out

    async def run(self, *, task_status: trio.TaskStatus[KubeletSimulator] = trio.TASK_STATUS_IGNORED) -> None:
        """Be the kubelet until cancelled; started() once kubelet.sock listens."""
        while True:
            asked = self._asked  # the restarts this start carries out
            if self._remove_directory:
                self._remove_directory = False
                # A running plugin may be creating its socket in it meanwhile: until it is gone.
                while os.path.lexists(self.device_plugin_dir):
                    shutil.rmtree(self.device_plugin_dir, ignore_errors=True)
            self._wipe_sockets()  # and the directory made again if it is missing, as the kubelet does
            self._restart = trio.Event()
            if self._hold is not None:
                hold, self._hold = self._hold, None
                await hold.wait()
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                await nursery.start(serve_grpc, self.socket_path, [self._registration_service(self.starts + 1)])
                self.starts += 1
                self._done = asked
                self._changed.touch()
                task_status.started(self)
                task_status = trio.TASK_STATUS_IGNORED
                await self._restart.wait()
                nursery.cancel_scope.cancel()

    def restart(self, *, remove_directory: bool = False, hold: trio.Event | None = None) -> None:
        """Restart like the kubelet: drop every stream, delete every socket, serve kubelet.sock again.

        With ``remove_directory``, the whole device-plugin directory is deleted while the kubelet is
        down (an administrator cleaning up, a node's reprovisioning), and made anew as it starts:
        a real kubelet creates its directory when missing (ManagerImpl.Start, os.MkdirAll).

        With ``hold``, the new kubelet.sock is made only once ``hold`` is set, the sockets wiped
        already: a plugin that notices may serve again before the kubelet listens. A real kubelet
        has that moment too: its registration server wipes the directory, then listens from
        another goroutine (server.Start in kubernetes/kubernetes
        pkg/kubelet/cm/devicemanager/plugin/v1beta1/server.go); and anyio binds in a worker
        thread, so this simulator has it for a moment even without ``hold``."""
        self._remove_directory = remove_directory
        self._hold = hold
        self._asked += 1
        self._restart.set()

    @property
    def restarting(self) -> bool:
        """Whether a restart() is not carried out yet: the kubelet.sock it makes does not listen yet."""
        return self._done < self._asked

    async def wait_until(self, predicate: Callable[[KubeletSimulator], bool]) -> None:
        """Return once ``predicate(self)`` is true; checked after every change the simulator sees."""
        while not predicate(self):
            await self._changed.wait_touched()

    def allocatable(self) -> dict[str, str]:
        """The node's status.allocatable for the device plugins' resources, as the kubelet writes it:
        each registered name with its healthy devices, 0 at once when its plugin's stream ended (the
        device manager marks them all unhealthy; GetCapacity in kubernetes/kubernetes
        pkg/kubelet/cm/devicemanager/manager.go keeps the name at 0 until endpointStopGracePeriod,
        5 minutes, has passed, then removes it: that removal is not modelled)."""
        return {name: str(resource.allocatable) for name, resource in self.resources.items()}

    async def allocate(
        self, resource_name: str, device_ids: Iterable[str], container: tuple[str, str, str] | None = None
    ) -> Any:
        """Call Allocate for one container, as the kubelet does while admitting a pod.

        Raises UnexpectedAdmissionError, without calling the plugin, while none of the resource's
        devices is healthy: between the end of its ListAndWatch stream and the next stream's first
        list, say. Such a refusal is also recorded in ``rejections``. With ``container``
        (namespace, pod, container name), an allocation the plugin answered is booked to it in
        ``pod_devices``, until remove_pod() (the pod is gone)."""
        self._admit(resource_name)
        device_ids = list(device_ids)
        request = v1beta1.AllocateRequest(container_requests=[v1beta1.ContainerAllocateRequest(devices_ids=device_ids)])
        response = await self._call(resource_name, "Allocate", request)
        if container is not None:
            namespace, pod, name = container
            held = self.pod_devices.setdefault((namespace, pod), {}).setdefault(name, {})
            held.setdefault(resource_name, []).extend(device_ids)
            self._changed.touch()
        return response

    def remove_pod(self, namespace: str, pod: str) -> None:
        """A pod that ended: the device manager frees its devices (no plugin call)."""
        self.pod_devices.pop((namespace, pod), None)
        self._changed.touch()

    def available(self, resource_name: str) -> list[str]:
        """The device IDs the kubelet would choose from for the next pod: the resource's healthy
        devices less every ID a pod holds (devicesToAllocate in kubernetes/kubernetes
        pkg/kubelet/cm/devicemanager/manager.go). By ID alone: a device a pod got from another
        plugin under another ID is "available" here, as it is to the kubelet."""
        resource = self.resources.get(resource_name)
        in_use = {
            device_id
            for containers in self.pod_devices.values()
            for held in containers.values()
            for device_id in held.get(resource_name, ())
        }
        healthy = (d for d, health in (resource.devices.items() if resource else ()) if health == HEALTHY)
        return sorted(d for d in healthy if d not in in_use)

    def _admit(self, resource_name: str, count: int = 0) -> None:
        # The device manager's checks before it asks the plugin (devicesToAllocate in
        # kubernetes/kubernetes pkg/kubelet/cm/devicemanager/manager.go): the resource must be
        # registered, have a healthy device, and ``count`` free. The pod's admission then fails for
        # good with "Allocate failed due to <error>, which is unexpected" (UnexpectedAdmissionError).
        resource = self.resources.get(resource_name)
        if resource is None:
            why = f"cannot allocate unregistered device {resource_name}"
        elif not resource.allocatable:
            why = f"no healthy devices present; cannot allocate unhealthy devices {resource_name}"
        elif (free := len(self.available(resource_name))) < count:
            why = f"requested number of devices unavailable for {resource_name}. Requested: {count}, Available: {free}"
        else:
            return
        message = f"Allocate failed due to {why}, which is unexpected"
        self.rejections.append((resource_name, message))
        self._changed.touch()
        raise UnexpectedAdmissionError(message)

    async def preferred_allocation(
        self, resource_name: str, available: Iterable[str], must_include: Iterable[str], size: int
    ) -> list[str]:
        """Call GetPreferredAllocation for one container and return the plugin's pick (after the
        same admission checks as allocate(): the kubelet asks only while allocating)."""
        self._admit(resource_name)
        container = v1beta1.ContainerPreferredAllocationRequest(
            available_deviceIDs=available, must_include_deviceIDs=must_include, allocation_size=size
        )
        request = v1beta1.PreferredAllocationRequest(container_requests=[container])
        response = await self._call(resource_name, "GetPreferredAllocation", request)
        return list(response.container_responses[0].deviceIDs)

    async def pre_start_container(self, resource_name: str, device_ids: Iterable[str]) -> Any:
        """Call PreStartContainer, as the kubelet does before starting a container that has devices."""
        request = v1beta1.PreStartContainerRequest(devices_ids=device_ids)
        return await self._call(resource_name, "PreStartContainer", request)

    async def _call(self, resource_name: str, method: str, request: Any) -> Any:
        endpoint = os.path.join(self.device_plugin_dir, self.resources[resource_name].endpoint)
        return await call_unary(endpoint, METHODS[f"/{API_VERSION}.DevicePlugin/{method}"], request, timeout=30)

    def _wipe_sockets(self) -> None:
        # The kubelet's first act on start: remove every unix socket in its directory (not regular
        # files, not directories). Plugins notice their socket gone, or the new kubelet.sock.
        try:
            entries = list(os.scandir(self.device_plugin_dir))
        except FileNotFoundError:
            os.makedirs(self.device_plugin_dir, exist_ok=True)
            return
        for entry in entries:
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
                    os.unlink(entry.path)

    def _registration_service(self, start: int) -> purerpc.Service:
        async def register_handler(request: Any) -> Any:
            try:
                return await self._register(request, start)
            except RPCError as error:
                self.refusals.append(error.message)
                self._changed.touch()
                raise

        service = purerpc.Service(f"{API_VERSION}.Registration")
        service.add_method("Register", register_handler, METHODS[REGISTER].signature)
        return service

    async def _register(self, request: Any, start: int) -> Any:
        # The kubelet's checks, with its own words; grpc-go reports them with code UNKNOWN.
        if request.version != API_VERSION:
            raise RPCError(
                StatusCode.UNKNOWN,
                f'requested API version "{request.version}" is not supported by kubelet. '
                f'Supported versions are ["{API_VERSION}"]',
            )
        if resource_name_problem(request.resource_name) is not None:
            raise RPCError(StatusCode.UNKNOWN, f'the ResourceName "{request.resource_name}" is invalid')
        # Dial back before answering: the plugin must already be serving.
        endpoint = os.path.join(self.device_plugin_dir, request.endpoint)
        method = METHODS[f"/{API_VERSION}.DevicePlugin/GetDevicePluginOptions"]
        try:
            options = await call_unary(endpoint, method, v1beta1.Empty(), timeout=KUBELET_DIAL_TIMEOUT)
        except RPCError as error:
            raise RPCError(StatusCode.UNKNOWN, f"failed to dial device plugin: {error.message}") from None
        # The kubelet keeps one client per resource *name* (registerClient): a new registration
        # replaces the old one in that table without closing the old one's stream.
        resource = SimulatedResource(request.endpoint, options, {})
        self.resources[request.resource_name] = resource
        self.registrations.append(request)
        self.registered_in.append(start)
        self.events.append(("registered", request.resource_name, request.endpoint))
        self._nursery.start_soon(self._list_and_watch, request.resource_name, resource, endpoint)
        self._changed.touch()
        return v1beta1.Empty()

    async def _list_and_watch(self, name: str, resource: SimulatedResource, endpoint: str) -> None:
        method = METHODS[f"/{API_VERSION}.DevicePlugin/ListAndWatch"]
        with resource.stream:
            try:
                async with open_stream(endpoint, method, v1beta1.Empty(), timeout=KUBELET_DIAL_TIMEOUT) as responses:
                    resource.streaming = True
                    self._changed.touch()
                    async for response in responses:
                        resource.devices = {device.ID: device.health for device in response.devices}
                        resource.topology = {
                            device.ID: tuple(node.ID for node in device.topology.nodes)
                            for device in response.devices
                            if device.HasField("topology")
                        }
                        resource.updates += 1
                        self._changed.touch()
            except RPCError as error:
                log.debug("simulated kubelet: ListAndWatch on %s ended: %s", endpoint, error)
            finally:
                resource.streaming = False
                self.events.append(("stream ended", name, resource.endpoint))
                # runClient (kubernetes/kubernetes pkg/kubelet/cm/devicemanager/plugin/v1beta1/
                # handler.go) looks the client up by resource *name* once a stream ends, and
                # disconnects the one registered now: a plugin that registered again before its old
                # stream ended loses the new registration here. Disconnecting marks every device of
                # the resource unhealthy at once (ManagerImpl.markResourceUnhealthy).
                current = self.resources[name]
                current.stream.cancel()
                current.streaming = False
                current.devices = dict.fromkeys(current.devices, UNHEALTHY)
                resource.devices = dict.fromkeys(resource.devices, UNHEALTHY)
                self.events.append(("disconnected", name, current.endpoint))
                self._changed.touch()


# The probe: what the kubelet would see of running plugins, right now. `gopherplug probe`.


@dataclass
class ProbeResult:
    """One resource as the kubelet would see it: its socket, options and device list, or an error."""

    resource: str
    endpoint: str = ""  #: the socket file probed ("" if none was found)
    options: Any = None  #: DevicePluginOptions
    status: Any = None  #: gopherplug's ResourceStatus (None: a plugin without the status service)
    devices: list[Any] = dataclasses.field(default_factory=list)  #: the first ListAndWatch message's devices
    error: str = ""  #: why the resource did not answer ("" if it did)


async def probe(
    device_plugin_dir: str, resource_names: Iterable[str] | None = None, grace: float = PROBE_STREAM_GRACE
) -> list[ProbeResult]:
    """Dial every gopherplug resource in the directory (or those of ``resource_names``) like the kubelet:
    GetDevicePluginOptions, gopherplug's status, then the first ListAndWatch message. Never raises
    for a plugin's failure.

    A resource fails when it does not answer, or when the kubelet has had no ListAndWatch stream
    open for more than ``grace`` seconds: it answers, but the kubelet is not using its devices.

    A resource may have several sockets: a plugin killed before it could clean up leaves its own,
    and numbers start again at 1 in every process. So each is tried, newest first, until one
    answers: nothing listens on a dead one, which refuses the connection at once."""
    sockets: dict[str, list[tuple[float, int, str]]] = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir(device_plugin_dir):
            if (parsed := parse_socket_name(entry.name)) is not None:
                with contextlib.suppress(OSError):
                    sockets.setdefault(parsed[0], []).append((entry.stat().st_mtime, parsed[1], entry.name))
    if resource_names is None:
        wanted = {resource_of_stem(stem) or stem: stem for stem in sockets}
    else:
        wanted = {name: socket_stem(name, device_plugin_dir) for name in resource_names}
    results = []
    for name in sorted(wanted) if resource_names is None else wanted:
        result = ProbeResult(name)
        results.append(result)
        candidates = [entry for *_, entry in sorted(sockets.get(wanted[name], []), reverse=True)]
        if not candidates:
            result.error = f"no gopherplug socket in {device_plugin_dir}"
        errors = []
        for endpoint in candidates:
            result.endpoint, result.error = endpoint, ""
            await _probe_socket(os.path.join(device_plugin_dir, endpoint), result)
            if not result.error:
                break
            errors.append((endpoint, result.error))
        else:
            if errors:  # none answered: say why the newest did not
                result.endpoint, result.error = errors[0]
        status = result.status
        if not result.error and status is not None and not status.streams and status.unstreamed_seconds > grace:
            result.error = (
                f"{result.endpoint} answers, but the kubelet has had no ListAndWatch stream from it for "
                f"{status.unstreamed_seconds:.0f} s (registered: {'yes' if status.registered else 'no'}): "
                "it is not using these devices"
            )
    return results


async def _probe_socket(path: str, result: ProbeResult) -> None:
    try:
        result.options = await call_unary(
            path, METHODS[f"/{API_VERSION}.DevicePlugin/GetDevicePluginOptions"], v1beta1.Empty(), timeout=PROBE_TIMEOUT
        )
        try:  # the kubelet's streams; ours below carries PROBE_METADATA and is not counted
            result.status = await call_unary(path, GET_STATUS, v1beta1.Empty(), timeout=PROBE_TIMEOUT)
        except RPCError as error:
            if error.code != StatusCode.UNIMPLEMENTED:  # else: a gopherplug older than its status service
                raise
        method = METHODS[f"/{API_VERSION}.DevicePlugin/ListAndWatch"]
        with trio.fail_after(PROBE_TIMEOUT):
            empty = v1beta1.Empty()
            async with open_stream(path, method, empty, timeout=PROBE_TIMEOUT, metadata=(PROBE_METADATA,)) as responses:
                async for response in responses:
                    result.devices = list(response.devices)
                    break
    except (RPCError, trio.TooSlowError) as error:
        result.error = f"did not answer on {result.endpoint}: {error or 'timed out'}"


def probe_report(results: list[ProbeResult]) -> str:
    """The probe's results as text: a line per resource, then a table of its devices."""
    lines = []
    for result in results:
        if result.error:
            lines.append(f"{result.resource}: FAILED: {result.error}")
            continue
        healthy = sum(device.health == HEALTHY for device in result.devices)
        features = [
            f"preferred allocation {'yes' if result.options.get_preferred_allocation_available else 'no'}",
            f"pre-start {'yes' if result.options.pre_start_required else 'no'}",
        ]
        if (status := result.status) is not None:
            features.append(f"registered {'yes' if status.registered else 'no'}")
            streamed = "open" if status.streams else f"none for {status.unstreamed_seconds:.0f} s"
            features.append(f"kubelet stream {streamed}")
        summary = f"{result.resource}: {result.endpoint}: {_devices(len(result.devices))}, {healthy} healthy"
        lines.append(f"{summary}; {', '.join(features)}")
        width = max([len("ID"), *(len(device.ID) for device in result.devices)])
        lines.append(f"  {'ID':<{width}}  {'HEALTH':<9}  NUMA")
        for device in result.devices:
            numa = ",".join(str(node.ID) for node in device.topology.nodes) or "-"
            lines.append(f"  {device.ID:<{width}}  {device.health:<9}  {numa}")
    return "\n".join(lines)


@dataclass
class DraProbeResult:
    """The DRA driver as the kubelet sees it: its registration socket's GetInfo, gopherplug's
    status on the endpoint, and the first health report (every device), or an error."""

    driver: str
    registration_socket: str
    info: Any = None  #: PluginInfo
    status: Any = None  #: ResourceStatus: registered, the kubelet's health streams
    health: Any = None  #: the first NodeWatchResourcesResponse
    error: str = ""


async def probe_dra(config: DraConfig, grace: float = PROBE_STREAM_GRACE) -> DraProbeResult:
    """Call the DRA driver ``config`` names as the kubelet does. Never raises for the driver's failure.

    It fails when a socket does not answer, when GetInfo names another driver, when the kubelet
    refused the registration, or when no kubelet registered it for more than ``grace`` seconds
    (the kubelet calls GetInfo within a second of the socket's creation: one that does not is
    watching another directory)."""
    result = DraProbeResult(config.driver, config.registration_socket)
    try:
        path, method, request = config.registration_socket, DRA_METHODS[GET_INFO], pluginregistration.InfoRequest()
        result.info = await call_unary(path, method, request, timeout=PROBE_TIMEOUT, metadata=(PROBE_METADATA,))
        endpoint = result.info.endpoint
        result.status = await call_unary(endpoint, GET_STATUS, v1beta1.Empty(), timeout=PROBE_TIMEOUT)
        method, watch = DRA_METHODS[NODE_WATCH_RESOURCES], drahealth.NodeWatchResourcesRequest()
        with trio.fail_after(PROBE_TIMEOUT):
            async with open_stream(
                endpoint, method, watch, timeout=PROBE_TIMEOUT, metadata=(PROBE_METADATA,)
            ) as reports:
                async for report in reports:
                    result.health = report
                    break
    except (RPCError, trio.TooSlowError) as error:
        result.error = f"did not answer: {error or 'timed out'}"
        return result
    status = result.status
    if result.info.name != config.driver:
        result.error = f"{config.registration_socket} is DRA driver {result.info.name}'s, not {config.driver}'s"
    elif status.registration_error:
        result.error = f"the kubelet refused the driver: {status.registration_error}"
    elif status.dropped and status.unregistered_seconds > grace:
        result.error = f"the kubelet registered it, then seems to have dropped it: {status.dropped}"
    elif not status.registered and status.unregistered_seconds > grace:
        result.error = (
            f"no kubelet has registered it in {status.unregistered_seconds:.0f} s: is {config.kubelet_dir} "
            "the kubelet's root directory?"
        )
    return result


def dra_probe_report(result: DraProbeResult) -> str:
    """A DRA probe's result as text: a line for the driver, then a table of its devices."""
    if result.error:
        return f"DRA driver {result.driver}: FAILED: {result.error}"
    devices = list(result.health.devices)
    healthy = sum(device.health == drahealth.HEALTHY for device in devices)
    status = result.status
    streamed = f"{status.streams} open" if status.streams else "none"
    lines = [
        f"DRA driver {result.driver}: {result.registration_socket} -> {result.info.endpoint}: "
        f"{_devices(len(devices))}, {healthy} healthy; registered {'yes' if status.registered else 'no'}, "
        f"kubelet health streams {streamed}"
    ]
    rows = [("POOL", "DEVICE", "HEALTH")]
    rows += [(d.device.pool_name, d.device.device_name, drahealth.NAMES[d.health]) for d in devices]
    widths = [max(len(row[column]) for row in rows) for column in range(2)]
    lines += [f"  {pool:<{widths[0]}}  {name:<{widths[1]}}  {health}" for pool, name, health in rows]
    return "\n".join(lines)


# `gopherplug who`: which container holds which device, from the kubelet's PodResources API.


def pod_resources_socket(config: Config) -> str:
    """Where this node's kubelet serves PodResources: pod-resources/kubelet.sock in its root
    directory, the DRA section's kubelet_dir or the parent of the device-plugin directory (the
    first known one that holds kubelet.sock when the configuration names none)."""
    if config.dra is not None:
        return os.path.join(config.dra.kubelet_dir, POD_RESOURCES_SOCKET)
    directory = config.device_plugin_dir or _kubelets_directory(KNOWN_DEVICE_PLUGIN_DIRS) or DEFAULT_DEVICE_PLUGIN_DIR
    return os.path.join(os.path.dirname(directory.rstrip("/")), POD_RESOURCES_SOCKET)


def scan_report(
    resource: ResourceConfig, scan: Scan, *container_problems: str, in_pod: Mapping[str, str] | None = None
) -> str:
    """What `check-config` shows of a resource: the devices the kubelet would be offered now, each
    with its health and the paths of its members (a symlink with the file it leads to), and under
    DRA its name in the ResourceSlice, then every entry skipped and why. ``in_pod``: for a member's
    path, why the shipped pod would find it unhealthy although this process does not (see
    pod_mode_problem)."""
    healthy = sum(device.health == HEALTHY for device in scan.devices)
    replicas = ""
    if resource.replicas > 1:  # under DRA alone, replicas are shares of the device (dra_shares)
        replicas = f" (each {'offered' if resource.device_plugin else 'shared by'} {resource.replicas} "
        replicas += f"{'times' if resource.device_plugin else 'claims'})"
    lines = [f"{resource.name}: {_devices(len(scan.devices))}, {healthy} healthy{replicas}, from {resource.origin()}"]
    lines += [f"  describe: {' '.join(resource.describe)}"] if resource.describe else []  # a relative path resolved
    lines += [f"  warning: {problem}" for problem in container_problems]
    if scan.problem:
        lines.append(f"  {scan.problem}")
    if scan.devices:
        width = max(len("ID"), *(len(device.id) for device in scan.devices))
        # Under DRA a device is known by its name in the ResourceSlice, which claims' results and
        # `kubectl get resourceslices` show: its ID only when that is a DNS label (dra_device_name).
        names = {device.id: dra_device_name(device.id) for device in scan.devices} if resource.dra else {}
        named = max(len("DRA NAME"), *map(len, names.values())) if names else 0
        column = f"{'DRA NAME':<{named}}  " if names else ""
        lines.append(f"  {'ID':<{width}}  {column}{'HEALTH':<9}  PATH")
        for device in scan.devices:
            for number, member in enumerate(device.members or (device,)):
                path = member.path + (f" -> {member.followed[-1]}" if member.followed else "")
                why = f" ({member.problem})" if member.problem else ""
                if pod_problem := (in_pod or {}).get(member.path):
                    why = f" (Unhealthy in the shipped pod: {pod_problem})"
                first = (device.id, names.get(device.id, ""), device.health) if number == 0 else ("", "", "")
                column = f"{first[1]:<{named}}  " if names else ""
                lines.append(f"  {first[0]:<{width}}  {column}{first[2]:<9}  {path}{why}")
            lines += _value_lines(resource, device, width + 4)
    lines += [f"  skipped {name!r}: {why}" for name, why in scan.skipped]
    return "\n".join(lines)


def _value_lines(resource: ResourceConfig, device: DeviceEntry, indent: int) -> list[str]:
    """For scan_report: the device's declared attributes and capacity, as its ResourceSlice entry will
    have them (name=value; a string quoted, a version marked), a line each."""
    lines = []
    if attributes := declared_attributes(resource, device):
        shown = [
            f"{name}={json.dumps(value) if kind in ('string', 'bool') else value}"
            + (" (version)" if kind == "version" else "")
            for name, typed in attributes.items()
            for kind, value in typed.items()
        ]
        lines.append(f"{' ' * indent}attributes: {', '.join(shown)}")
    if capacity := device_capacity(resource, device):
        shown = [f"{name}={quantity['value']}" for name, quantity in capacity.items()]
        lines.append(f"{' ' * indent}capacity: {', '.join(shown)}")
    return lines


def described_scan(resource: ResourceConfig, scan: Scan) -> tuple[Scan, list[str]]:
    """For check-config: the scan's devices with what their ``attributes`` and ``capacity`` files
    and the resource's ``describe`` say of them now (describe run once, as serve runs it), and a
    line for each value left out and for a describe that failed."""
    if not (resource.attributes or resource.capacity or resource.describe) or not scan.devices:
        return scan, []
    problems: list[str] = []
    described: dict[str, ReadValues] = {}
    if resource.describe:
        try:
            described, unknown = trio.run(run_describe, resource, [device.id for device in scan.devices])
        except DescribeError as error:
            problems.append(f"{error}: the devices would be offered without what it says")
        else:
            if unknown:
                problems.append(
                    f"describe {resource.describe[0]} described {', '.join(unknown)}: not among the devices"
                )
    devices = []
    for device in scan.devices:
        files, read_problems = read_declared_values(resource, device)
        entry, more = with_read_values(resource, device, files, described.get(device.id))
        devices.append(entry)
        problems += [f"device {device.id}: {key}: {why}" for key, why in read_problems + more]
    return dataclasses.replace(scan, devices=tuple(devices)), problems


def missing_source_problems(resource: ResourceConfig, sysfs_root: str = "/sys", dev_root: str = "/dev") -> list[str]:
    """For check-config: each place the resource's devices come from that is not there, a line each.
    ``serve`` waits for a missing directory and offers no devices until it appears, which is right
    for hardware not plugged in yet and the same as for a typo: check-config says which. A
    directory that names a device or a glob says what to write instead (directory_mistake)."""
    directories = [source.directory for source in resource.sources]
    problems = []
    for place in dict.fromkeys(directories + ([dev_root] if resource.usb else [])):
        if place in directories and (mistake := directory_mistake(place, _mode(place))):
            problems.append(mistake)
        elif not os.path.exists(place):
            problems.append(f"{place} does not exist (yet): serve waits for it")
        elif not os.path.isdir(place):
            problems.append(f"{place} is not a directory: serve finds no devices until it is one")
    if resource.usb and not os.path.isdir(usb := os.path.join(sysfs_root, "bus", "usb", "devices")):
        problems.append(f"{usb} does not exist: this machine has no USB bus (yet)")
    return problems


def container_report(resource: ResourceConfig, scan: Scan, driver: str = "", node_name: str = "") -> tuple[str, bool]:
    """For check-config: what a container gets for the resource's first healthy device, from the code
    that answers the kubelet: Allocate for one kubelet ID of it (the device-plugin API), and for DRA
    (given the ``driver``) the CDI IDs NodePrepareResources gives for a claim allocated that device,
    with the CDI spec's containerEdits for it and its ResourceSlice pool and attributes. And whether
    Allocate would refuse it (a warning: every pod given that device would fail)."""
    device = next((d for d in scan.devices if d.health == HEALTHY), None)
    if device is None:
        return "  a container: none, no healthy device to give", False
    refused = False
    devices, lines = {d.id: d for d in scan.devices}, []
    if resource.device_plugin:
        kubelet_id = resource.replica_ids(device.id)[0]
        wanted = v1beta1.ContainerAllocateRequest(devices_ids=[kubelet_id])
        request = v1beta1.AllocateRequest(container_requests=[wanted])
        try:
            answer = allocate_response(resource, devices, request).container_responses[0]
        except RPCError as error:
            lines.append(f"  warning: Allocate {kubelet_id} fails, and so would every pod given it: {error.message}")
            refused = True
        else:
            lines.append(f"  Allocate {kubelet_id} gives a container:")
            lines += [f"    device {d.container_path} <- {d.host_path} {d.permissions}" for d in answer.devices]
            lines += [
                f"    mount {m.container_path} <- {m.host_path} {'ro' if m.read_only else 'rw'}" for m in answer.mounts
            ]
            lines += [f"    env {name}={value}" for name, value in sorted(answer.envs.items())]
            lines += [f"    annotation {key}={value}" for key, value in sorted(answer.annotations.items())]
            lines += [f"    cdi {cdi.name}" for cdi in answer.cdi_devices]
    if resource.dra and driver:
        pool, name = dra_pool_name(node_name, resource.name), dra_device_name(device.id)
        # The claim's UID and request shown as placeholders: the API server's and the claim's author's.
        result = {"request": "<request>", "driver": driver, "pool": pool, "device": name}
        # A shared device's claim holds a share of it: shown with "<shareID>" for the scheduler's UUID.
        share = "00000000-0000-4000-8000-000000000000" if resource.replicas > 1 else ""
        if share:
            result["shareID"] = share
        uid = "<claimUID>"
        claim = {
            "metadata": {"namespace": "check-config", "name": "claim", "uid": uid},
            "status": {"allocation": {"devices": {"results": [result]}}},
        }
        prepared = prepared_devices(claim, uid, driver, {pool: (resource, devices)})
        specs = [spec for _, spec in claim_cdi_specs(claim, driver, {pool: (resource, devices)})]
        specs.append(cdi_spec(resource, [device]) or {})
        described = {f"{spec['kind']}={d['name']}": d["containerEdits"] for spec in specs for d in spec["devices"]}
        edits = described[prepared[0].cdi_device_ids[0]]
        # The env as the container sees it: every CDI device's, in the order the kubelet names them
        # (the runtime keeps the last value of a variable set twice).
        env: dict[str, str] = {}
        for cdi_id in prepared[0].cdi_device_ids:
            for variable in described[cdi_id].get("env", ()):
                key, _, value = variable.partition("=")
                env[key] = value
        attributes = dra_device(resource, device)["attributes"]
        shown = ", ".join(
            f"{key}={json.dumps(value) if not isinstance(value, str) else value}"
            for key, typed in attributes.items()
            for value in typed.values()
        )
        first = len(lines)
        held = f"a share of device {name} (1 of {resource.replicas})" if share else f"device {name}"
        lines.append(f"  a claim for {held} of pool {pool} gives a container:")
        lines.append(f"    attributes {shown}")
        lines += [f"    cdi {cdi_id}" for each in prepared for cdi_id in each.cdi_device_ids]
        lines += [f"    device {n['path']} <- {n['hostPath']} {n['permissions']}" for n in edits.get("deviceNodes", ())]
        lines += [
            f"    mount {m['containerPath']} <- {m['hostPath']} {m['options'][-1]}" for m in edits.get("mounts", ())
        ]
        lines += [f"    env {key}={value}" for key, value in sorted(env.items())]
        if share:
            lines[first:] = [line.replace(share, "<shareID>") for line in lines[first:]]
    return "\n".join(lines), refused


# The demo: the simulator above and the real plugin, side by side, narrated. `gopherplug demo`.
DEMO_STEP_TIMEOUT = 10.0  # each step takes milliseconds; this only stops a broken demo from hanging
DEMO_CONFIG = """\
# The demo's configuration: every file in the temporary directory is one gopher device.
resources:
  - name: example.com/gopher
    directory: {devices}
    env: GOPHER_DEVICES
    device_specs:
      - host_path: "{{path}}"
        container_path: /dev/gopher{{index}}
        permissions: rw
"""


@contextlib.contextmanager
def _demo_root(prefix: str, driver: str) -> Iterator[str]:
    """A demo's temporary directory, in TMPDIR, removed with all in it: refused in one line where its
    longest socket (the DRA registration's, a device plugin's named by digest) would pass MAX_SOCKET_PATH."""
    root, tmp = tempfile.mkdtemp(prefix=prefix), tempfile.gettempdir()
    longest = max(len(f"/kubelet/plugins_registry/{driver}-reg.sock"), len(f"/device-plugins/{'0' * 32}.sock"))
    try:
        if (room := MAX_SOCKET_PATH - longest - len(root) + len(tmp)) < len(tmp):
            why = f"TMPDIR {tmp} is too long for the demo's unix sockets ({MAX_SOCKET_PATH} bytes at most)"
            raise GopherplugError(f"{why}: set TMPDIR to a directory of at most {room} characters, such as /tmp")
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def run_demo(out: Callable[[str], None] = print) -> None:
    """Run the plugin against the kubelet simulator in a temporary directory, telling each step.

    Leaves nothing behind: the directory, its sockets and its files are gone when this returns."""
    with _demo_root("gopherplug-demo-", "") as root:
        plugin_dir, devices = os.path.join(root, "device-plugins"), os.path.join(root, "gophers")
        os.mkdir(plugin_dir)
        os.mkdir(devices)
        for name in ("gopher0", "gopher1", "gopher2"):
            open(os.path.join(devices, name), "x").close()
        config = parse_config(DEMO_CONFIG.format(devices=devices), "<demo>")
        config = dataclasses.replace(config, device_plugin_dir=plugin_dir)
        await _narrate_demo(config, plugin_dir, devices, out)


async def _narrate_demo(config: Config, plugin_dir: str, devices: str, out: Callable[[str], None]) -> None:
    resource = config.resources[0].name
    say = _demo_clock(out)

    async def wait_for(what: str, predicate: Callable[[KubeletSimulator], bool]) -> float:
        """Milliseconds until ``predicate`` holds, what the kubelet saw meanwhile said."""
        start = trio.current_time()
        await _demo_step(what, kubelet.wait_until(predicate))
        narrate()
        return (trio.current_time() - start) * 1e3

    out(f"gopherplug demo: a simulated kubelet and the real plugin, in {os.path.dirname(devices)}")
    async with trio.open_nursery() as nursery:
        kubelet = await nursery.start(KubeletSimulator(plugin_dir).run)
        narrate = KubeletNarrator(kubelet, say)
        say("kubelet", f"serving Registration on {kubelet.socket_path} (sockets of the directory wiped)")
        await nursery.start(serve_plugin, config)
        say("plugin", f"watching {devices}; serving DevicePlugin on a socket in {plugin_dir}")
        await wait_for("the first device list", lambda k: resource in k.resources and k.resources[resource].updates > 0)
        await _kubelet_allocate(kubelet, resource, 2, say, "demo-pod")
        # `gopherplug who`: the kubelet's PodResources answer, read against the configuration.
        socket_path = os.path.join(os.path.dirname(plugin_dir), POD_RESOURCES_SOCKET)
        await nursery.start(PodResourcesSimulator(socket_path, kubelet).run)
        pods = await list_pod_resources(socket_path)
        scanned = [(r, scan_directory(r).devices) for r in config.resources]
        for line in who_report(device_holders(scanned, pods)).splitlines():
            say("who", line.replace(devices + os.sep, ""))

        open(added := os.path.join(devices, "gopher3"), "x").close()
        say("demo", f"created {added}")
        took = await wait_for("the new device's update", lambda k: "gopher3" in k.resources[resource].devices)
        say("demo", f"the kubelet had the new list {took:.1f} ms after the file was created")
        registrations = len(kubelet.registrations)
        kubelet.restart()
        took = await wait_for(
            "re-registration",
            lambda k: len(k.registrations) > registrations and len(k.resources[resource].devices) == 4,
        )
        say("demo", f"the plugin saw the new kubelet.sock and registered again, listed: {took:.1f} ms")
        nursery.cancel_scope.cancel()
    say("demo", "done: plugin stopped, its sockets removed")


def _answer_lines(answer: Any) -> list[str]:
    """What one ContainerAllocateResponse gives the container, a line each."""
    lines = [f"device {spec.host_path} -> {spec.container_path} ({spec.permissions})" for spec in answer.devices]
    lines += [f"mount {m.host_path} -> {m.container_path} ({'ro' if m.read_only else 'rw'})" for m in answer.mounts]
    lines += [f"env {key}={value}" for key, value in sorted(answer.envs.items())]
    lines += [f"annotation {key}={value}" for key, value in sorted(answer.annotations.items())]
    return lines + [f"CDI device {cdi.name}" for cdi in answer.cdi_devices]


# `gopherplug kubelet --device-plugin-dir DIR`: the simulator in the foreground, narrated, to watch
# a device plugin (`gopherplug serve --device-plugin-dir DIR`, or any other) without a cluster.
#: What `gopherplug kubelet` takes on its standard input, a line each.
KUBELET_REQUESTS = "allocate [RESOURCE [N]] (an empty line: one device of each resource), free, restart"
_KUBELET_PODS = itertools.count(1)  # the pods `gopherplug kubelet` admits, named in order


class KubeletNarrator:
    """Says what a KubeletSimulator saw since it was last asked (``narrator()``): each registration or
    refusal, each ListAndWatch list with the health changes it brings, each stream's end, each
    restart. ``follow()`` says it as it happens, until cancelled; a demo asks after each step."""

    def __init__(self, kubelet: KubeletSimulator, say: Callable[[str, str], None]) -> None:
        self.kubelet, self.say = kubelet, say
        self._told: tuple[Any, ...] = (0, 0, 0, kubelet.starts)  # registrations, refusals, events, starts
        self._lists: dict[str, tuple[SimulatedResource, int, dict[str, str]]] = {}  # what was said of each

    def _state(self) -> tuple[Any, ...]:
        k = self.kubelet
        return len(k.registrations), len(k.refusals), len(k.events), k.starts, [r.updates for r in k.resources.values()]

    def __call__(self) -> None:
        kubelet, say, told = self.kubelet, self.say, self._told
        for event, name, endpoint in kubelet.events[told[2] :]:  # a stream ends before what follows
            if event == "stream ended":
                say("kubelet", f"ListAndWatch of {name} on {endpoint} ended")
            elif event == "disconnected":
                say("kubelet", f"{name} disconnected: every device unhealthy, allocatable 0, until it registers again")
        if kubelet.starts != told[3]:
            say("kubelet", "restarted: every socket in its directory deleted, kubelet.sock served again")
        for request in kubelet.registrations[told[0] :]:
            name, endpoint = request.resource_name, request.endpoint
            say("plugin", f"Register(resource {name}, endpoint {endpoint}, version {request.version})")
            if (known := kubelet.resources.get(name)) is not None and known.endpoint == endpoint:
                say("kubelet", f"dialed {endpoint} back before answering: {_one_line(known.options)}")
        for refusal in kubelet.refusals[told[1] :]:
            say("kubelet", f"Register refused: {refusal}")
        for name, resource in kubelet.resources.items():
            was, updates, before = self._lists.get(name, (None, 0, {}))
            if resource.updates and (resource is not was or resource.updates != updates):
                listed = [f"{d} {h}" for d, h in sorted(resource.devices.items(), key=lambda i: _natural_key(i[0]))]
                say("plugin", f"ListAndWatch {name}: {_named(listed, DEMO_LIST_LENGTH) or 'none'}")
                changed = [f"{d} {before[d]} -> {h}" for d, h in resource.devices.items() if before.get(d, h) != h]
                whole = f"capacity {resource.capacity}, allocatable {resource.allocatable}"
                say("kubelet", f"{name}: {whole}" + (f" ({', '.join(changed)})" if changed else ""))
            self._lists[name] = (resource, resource.updates, dict(resource.devices))
        self._told = self._state()

    async def follow(self) -> None:
        while True:
            self()
            await self.kubelet.wait_until(lambda _: self._state() != self._told)


async def kubelet_request(kubelet: KubeletSimulator, line: str, say: Callable[[str, str], None]) -> None:
    """Carry out one of KUBELET_REQUESTS, as the kubelet would for a pod: ``allocate`` picks the
    devices no pod holds (asking GetPreferredAllocation where the plugin offers it), calls Allocate
    for a new pod's container and PreStartContainer where the plugin asks for it, or fails the pod's
    admission where too few are free; ``free`` ends every pod; ``restart`` restarts the kubelet."""
    words = line.split()
    if words in ([], ["allocate"]) or (words[0] == "allocate" and len(words) <= 3):
        count = words[2] if len(words) == 3 else "1"
        if not count.isdigit() or int(count) == 0:
            say("kubelet", f"allocate: {count!r} is not a number of devices")
            return
        if not kubelet.resources and len(words) < 2:
            say("kubelet", "allocate: no resource is registered yet")
        for name in words[1:2] or sorted(kubelet.resources):
            await _kubelet_allocate(kubelet, name, int(count), say)
    elif words == ["free"]:
        for namespace, pod in list(kubelet.pod_devices):
            kubelet.remove_pod(namespace, pod)
            say("kubelet", f"pod {namespace}/{pod} ended: its devices are free (no plugin call)")
    elif words == ["restart"]:
        kubelet.restart()
    else:
        say("kubelet", f"{line.strip()!r}: ask for one of: {KUBELET_REQUESTS}")


async def _kubelet_allocate(
    kubelet: KubeletSimulator, name: str, count: int, say: Callable[[str, str], None], pod: str = ""
) -> None:
    if (resource := kubelet.resources.get(name)) is None:
        say("kubelet", f"allocate: {name} is not registered (registered: {', '.join(kubelet.resources) or 'none'})")
        return
    pod = pod or f"pod-{next(_KUBELET_PODS)}"
    available = kubelet.available(name)
    try:
        kubelet._admit(name, count)  # too few free: the pod fails, and is never admitted again
        chosen = available[:count]
        if resource.options.get_preferred_allocation_available:
            chosen = await kubelet.preferred_allocation(name, available, [], count)
            shown = _named(available, DEMO_LIST_LENGTH)
            say("plugin", f"GetPreferredAllocation(size {count} of {shown}): {', '.join(chosen)}")
        say("kubelet", f"pod default/{pod} asks for {count} {name}: Allocate({', '.join(chosen)})")
        answer = await kubelet.allocate(name, chosen, container=("default", pod, "app"))
        for line in _answer_lines(answer.container_responses[0]):
            say("plugin", f"  {line}")
        if resource.options.pre_start_required:
            await kubelet.pre_start_container(name, chosen)
            say("plugin", f"PreStartContainer({', '.join(chosen)}): done")
    except GopherplugError as error:  # the kubelet's admission (for good), or the plugin's refusal
        why = f"refused: {error.message}" if isinstance(error, RPCError) else f"{type(error).__name__}: {error}"
        say("kubelet", f"pod default/{pod} asks for {count} {name}: {why}")


def _one_line(message: Any) -> str:
    # Not protobuf's text_format: importing it costs the plugin 2.7 MB of memory for one demo line.
    return ", ".join(f"{field.name}: {value}" for field, value in message.ListFields()) or "(defaults)"


def _demo_clock(out: Callable[[str], None], width: int = 8) -> Callable[[str, str], None]:
    """say(who, what): one narrated line, stamped with the milliseconds since the demo began."""
    start = trio.current_time()

    def say(who: str, what: str) -> None:
        out(f"{(trio.current_time() - start) * 1e3:8.1f} ms  {who:<{width}} {what}")

    return say


async def _demo_step(what: str, happened: Awaitable[None]) -> None:
    with trio.move_on_after(DEMO_STEP_TIMEOUT):
        await happened
        return
    raise GopherplugError(f"demo: {what} did not happen within {DEMO_STEP_TIMEOUT:.0f} s")


# The DRA side of the kubelet, and an API server, in miniature.
#
# DraKubeletSimulator is the kubelet's plugin watcher and DRA manager as a driver sees them: it
# watches plugins_registry with inotify (and walks it when it starts), calls GetInfo on each new
# socket, checks the answer, dials the endpoint, reports with NotifyRegistrationStatus, forgets a
# driver whose socket is deleted, wipes ResourceSlices as the kubelet does, and calls
# NodePrepareResources and NodeUnprepareResources on demand. LenientApiServer serves the
# handful of resource.k8s.io/v1 requests a driver makes (its Node and claims read, slices written
# and watched, claim status applied) over HTTP/1.1, checking nothing: the demo's needs.

#: How long the kubelet gives each call to a DRA plugin (defaultClientCallTimeout, formerly
#: PluginClientTimeout, in kubernetes/kubernetes pkg/kubelet/cm/dra/plugin/dra_plugin.go).
DRA_KUBELET_TIMEOUT = 45.0

#: How long the kubelet's registration gives GetInfo, and NotifyRegistrationStatus (kubernetes/kubernetes
#: pkg/kubelet/pluginmanager/operationexecutor/operation_generator.go, GenerateRegisterPluginFunc).
DRA_GET_INFO_TIMEOUT, DRA_NOTIFY_TIMEOUT = 1.0, 5.0

#: How long a DRA driver has to register again before the kubelet deletes its ResourceSlices
#: (defaultWipingDelay in kubernetes/kubernetes pkg/kubelet/cm/dra/manager.go).
DRA_WIPING_DELAY = 30.0


@dataclass
class SimulatedDriver:
    """What the simulated kubelet knows of one registered DRA driver."""

    name: str
    endpoint: str  #: the DRAPlugin socket GetInfo named
    service: str  #: the DRAPlugin service chosen from supported_versions ("k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin")
    registration_socket: str
    supported_versions: tuple[str, ...] = ()  #: as GetInfo listed them
    #: whether the kubelet's connection to the endpoint is up (DraKubeletSimulator._connect)
    connected: bool = dataclasses.field(default=False, compare=False)
    #: the kept connection's scope: cancelled when the plugin is deregistered or dropped
    connection: trio.CancelScope = dataclasses.field(default_factory=trio.CancelScope, compare=False, repr=False)


#: What a gRPC client sends first on a connection: HTTP/2's preface and an empty SETTINGS frame (a
#: server closes a connection that does not greet it, as gopherplug's does after HANDSHAKE_TIMEOUT).
_HTTP2_GREETING = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


class DraKubeletSimulator:
    """A stand-in for the kubelet's plugin watcher and DRA manager, on a kubelet directory of your choice.

    ``await nursery.start(simulator.run)``; ``restart()`` behaves like a kubelet restart (which
    deletes nothing here: plugins_registry is walked again); ``wait_until(predicate)`` waits
    without polling. ``wipe(driver)``, if given, deletes this node's ResourceSlices of a driver
    ("": of every driver), as the kubelet does when it starts and ``wiping_delay`` seconds after a
    driver went without registering again.

    A driver may register from several registration sockets (a rolling update's two pods), as the
    kubelet's DRA plugin manager allows (kubernetes/kubernetes
    pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go): ``plugins`` keeps them in the order they
    registered; an endpoint registered twice is refused; calls go to the newest one that is
    connected, else the newest (``drivers``); the driver's slices are wiped ``wiping_delay`` after
    one deregisters only if none that is left is connected.

    Connected is the state of the connection the kubelet keeps to each registered plugin
    (DRAPlugin.HandleConn in pkg/kubelet/cm/dra/plugin): here, a unix socket connection made as the
    plugin registers, greeted as HTTP/2, kept until the plugin closes it or is deregistered. A call
    to a plugin that is not connected connects it again, as an RPC on an idle gRPC channel does.

    At start the kubelet registers the sockets already in plugins_registry in Go's random map order
    (pkg/kubelet/pluginmanager's reconciler): ``order`` shuffles them with a random.Random of
    ``seed`` (drawn at random unless given); a test may set ``order`` to a function of its own.
    """

    def __init__(
        self,
        kubelet_dir: str,
        versions: Iterable[str] = ("v1.DRAPlugin", "v1beta1.DRAPlugin"),
        wipe: Callable[[str], None] | None = None,
        wiping_delay: float = DRA_WIPING_DELAY,
        health_versions: Iterable[str] = (DRA_HEALTH_VERSION,),
        seed: int | None = None,
    ) -> None:
        self.registry = os.path.join(kubelet_dir, "plugins_registry")
        self.seed = seed if seed is not None else random.randrange(2**32)  #: of the registration order at start
        shuffler = random.Random(self.seed)
        #: the order the sockets found at start are registered in (see the class's docstring)
        self.order: Callable[[list[str]], list[str]] = lambda names: shuffler.sample(names, len(names))
        self._connections: trio.Nursery | None = None  # the kept connections' nursery, while running
        self.versions = list(versions)  #: the DRAPlugin versions this kubelet speaks
        self.wipe, self.wiping_delay = wipe, wiping_delay
        #: the DRAResourceHealth versions this kubelet speaks, the one it prefers first
        self.health_versions = list(health_versions)
        self.health_paths: list[str] = []  #: each NodeWatchResources stream opened, by its path
        self.drivers: dict[str, SimulatedDriver] = {}  #: registered drivers by name: the plugin last registered
        #: every registered plugin of each driver, in the order they registered
        self.plugins: dict[str, list[SimulatedDriver]] = {}
        #: ("registered" | "refused: why" | "deregistered" | "asked" | "dropped", socket), ("wiped", driver)
        self.events: list[tuple[str, str]] = []
        self.starts = 0
        self._changed = Watched(None)
        self._restart = trio.Event()
        self._pending_wipes: dict[str, trio.CancelScope] = {}
        #: claim UID -> driver -> the devices its NodePrepareResources answered (the kubelet's
        #: claim info cache, kept across its restarts in its checkpoint, as here)
        self.prepared: dict[str, dict[str, list[Any]]] = {}
        self._marked: set[str] = set()  # claim UIDs of batches that succeeded: prepared, for the kubelet
        #: (namespace, pod) -> container -> the claims (namespace, name, UID) it names in
        #: resources.claims: the pod specs PodResources reads (use_claims, remove_pod)
        self.pod_claims: dict[tuple[str, str], dict[str, list[tuple[str, str, str]]]] = {}

    async def run(self, *, task_status: trio.TaskStatus[DraKubeletSimulator] = trio.TASK_STATUS_IGNORED) -> None:
        os.makedirs(self.registry, exist_ok=True)
        while True:
            self.drivers.clear()
            self.plugins.clear()
            self._restart = trio.Event()
            # A starting kubelet knows no driver yet, so it advertises no local device: it deletes
            # this node's slices of every driver, at once (NewDRAPluginManager, pkg/kubelet/cm/dra/plugin).
            self._wipe("")
            with DirectoryWatch(self.registry, flags.CREATE | flags.DELETE | flags.MOVED_FROM | flags.MOVED_TO) as w:
                async with trio.open_nursery() as nursery:
                    self._connections = nursery  # a restart closes every connection with it
                    # At start, every socket already there, in no set order; then each one created.
                    for name in self.order(os.listdir(self.registry)):
                        await self._register(os.path.join(self.registry, name))
                    self.starts += 1
                    self._changed.touch()
                    task_status.started(self)
                    task_status = trio.TASK_STATUS_IGNORED
                    nursery.start_soon(self._follow, w)
                    await self._restart.wait()
                    nursery.cancel_scope.cancel()

    async def _follow(self, watch: DirectoryWatch) -> None:
        async with trio.open_nursery() as wipes, contextlib.aclosing(watch.batches()) as batches:
            async for events, _, _ in batches:
                for gone in self._forget(events):
                    wipes.start_soon(self._wipe_later, gone)
                for name, mask in events:
                    if mask & (flags.CREATE | flags.MOVED_TO):
                        await self._register(os.path.join(self.registry, name))
                self._changed.touch()

    def _forget(self, events: list[tuple[str, int]]) -> list[str]:
        """Deregister the drivers whose registration sockets went (the kubelet's watcher on Remove)."""
        gone = []
        for name, mask in events:
            path = os.path.join(self.registry, name)
            if mask & (flags.DELETE | flags.MOVED_FROM):
                for plugins in list(self.plugins.values()):
                    for plugin in [p for p in plugins if p.registration_socket == path]:
                        plugins.remove(plugin)
                        plugin.connection.cancel()
                        self.events.append(("deregistered", path))
                        self._sync(plugin.name)
                        # DRAPluginManager.sync: slices wait for their wipe only when no plugin of
                        # the driver that is left is usable (connected).
                        if not any(p.connected for p in plugins):
                            gone.append(plugin.name)
        return gone

    def _sync(self, driver: str) -> None:
        """``drivers`` after a plugin of ``driver`` came or went: its newest plugin, if any."""
        if plugins := self.plugins.get(driver):
            self.drivers[driver] = plugins[-1]
        else:
            self.plugins.pop(driver, None)
            self.drivers.pop(driver, None)

    async def _wipe_later(self, driver: str) -> None:
        """A driver that went may have died without cleaning up; one that registers again in time
        (a restart, a rolling update) keeps its slices (the DRA plugin manager's pendingWipes)."""
        if (earlier := self._pending_wipes.get(driver)) is not None:
            earlier.cancel()
        with trio.CancelScope() as scope:
            self._pending_wipes[driver] = scope
            await trio.sleep(self.wiping_delay)
            self._wipe(driver)
        if self._pending_wipes.get(driver) is scope:
            del self._pending_wipes[driver]

    def _wipe(self, driver: str) -> None:
        if self.wipe is not None:
            self.wipe(driver)
            self.events.append(("wiped", driver))
            self._changed.touch()

    async def _register(self, path: str) -> None:
        # The plugin watcher skips hidden files and anything that is not a socket.
        with contextlib.suppress(OSError):
            if os.path.basename(path).startswith(".") or not stat.S_ISSOCK(os.stat(path).st_mode):
                return
        # The kubelet's reconciler registers what the watcher found once a second, and a failed
        # registration starts again from GetInfo after a backoff: a socket seen at bind() is called
        # once it listens. Here, sooner. GetInfo has one second each time.
        delay, request = 0.005, pluginregistration.InfoRequest()
        while True:
            try:
                info = await call_unary(path, DRA_METHODS[GET_INFO], request, timeout=DRA_GET_INFO_TIMEOUT)
                break
            except RPCError as error:
                retried = error.code in (StatusCode.UNAVAILABLE, StatusCode.DEADLINE_EXCEEDED)
                if not retried or delay > 1 or not os.path.exists(path):
                    self.events.append((f"refused: GetInfo failed: {error}", path))
                    return
            await trio.sleep(delay)
            delay *= 2
        problem = None
        # The first of the plugin's versions that the kubelet speaks (validateSupportedServices in
        # pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go; 1.32 and 1.33 went by their own order).
        chosen = next((v for v in info.supported_versions if v in self.versions), None)
        if info.type != DRA_PLUGIN_TYPE:
            problem = f"type {info.type!r} is not {DRA_PLUGIN_TYPE}"
        elif chosen is None:
            problem = f"none of the versions {list(info.supported_versions)} is supported"
        elif not os.path.isabs(info.endpoint) or not os.path.exists(info.endpoint):
            problem = f"endpoint {info.endpoint!r} does not exist"
        elif any(p.endpoint == info.endpoint for p in self.plugins.get(info.name, [])):
            # One plugin instance cannot take over another's endpoint (DRAPluginManager.add).
            problem = f"endpoint {info.endpoint} already registered for DRA driver plugin {info.name}"
        status = pluginregistration.RegistrationStatus(plugin_registered=problem is None, error=problem or "")
        with contextlib.suppress(RPCError):
            await call_unary(path, DRA_METHODS[NOTIFY_REGISTRATION_STATUS], status, timeout=DRA_NOTIFY_TIMEOUT)
        if problem is not None:
            self.events.append((f"refused: {problem}", path))
            return
        if (pending := self._pending_wipes.pop(info.name, None)) is not None:
            pending.cancel()  # back in time: its slices stay
        package = dict(DRA_VERSIONS)[str(chosen)]
        plugin = SimulatedDriver(info.name, info.endpoint, f"{package}.DRAPlugin", path, tuple(info.supported_versions))
        assert self._connections is not None
        await self._connections.start(self._connect, plugin)
        self.plugins.setdefault(info.name, []).append(plugin)
        self._sync(info.name)
        self.events.append(("registered", path))
        self._changed.touch()

    async def _connect(self, plugin: SimulatedDriver, *, task_status: trio.TaskStatus[None]) -> None:
        """Connect to the plugin's endpoint and keep the connection: ``connected`` while it is up.
        started() once it is up, or could not be made."""
        started = False
        with plugin.connection:
            try:
                async with await trio.open_unix_socket(plugin.endpoint) as stream:
                    await stream.send_all(_HTTP2_GREETING)
                    plugin.connected = started = True
                    task_status.started()
                    while await stream.receive_some():
                        pass  # the server's SETTINGS and their ack: not looked at
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # refused, or closed by the plugin
            finally:
                plugin.connected = False
                self._changed.touch()
        if not started:
            task_status.started()

    def restart(self) -> None:
        """Restart like the kubelet: forget every driver, find them again in plugins_registry."""
        self._restart.set()

    async def wait_until(self, predicate: Callable[[DraKubeletSimulator], bool]) -> None:
        while not predicate(self):
            await self._changed.wait_touched()

    async def prepare(self, driver: str, claims: Iterable[tuple[str, str, str]]) -> Any:
        """NodePrepareResources for (namespace, uid, name) claims, one batch as the kubelet sends a
        pod's; the response. Calling it again is the kubelet's retry. It takes the answers in a Go
        map's (random) order, appending each claim's devices to what it holds (ClaimInfo.addDevice)
        until it meets an error (prepareResources in kubernetes/kubernetes
        pkg/kubelet/cm/dra/manager.go): here the claims without an error come first, the order
        that keeps the most. A claim whose batch succeeded before gets its devices as answered now."""
        claims = list(claims)
        response = await self._call(driver, "NodePrepareResources", drapb.NodePrepareResourcesRequest, claims)
        for uid, answer in sorted(response.claims.items(), key=lambda item: bool(item[1].error)):
            if answer.error:
                return response  # the kubelet returns here: no claim of the batch is marked prepared
            held = self.prepared.setdefault(uid, {})
            if uid in self._marked:
                held[driver] = list(answer.devices)
            else:
                held.setdefault(driver, []).extend(answer.devices)
        self._marked.update(uid for _, uid, _ in claims)
        return response

    def use_claims(self, namespace: str, pod: str, container: str, claims: Iterable[tuple[str, str, str]]) -> None:
        """A container of a running pod names these claims (namespace, name, UID) in resources.claims."""
        self.pod_claims.setdefault((namespace, pod), {}).setdefault(container, []).extend(claims)

    def remove_pod(self, namespace: str, pod: str) -> None:
        """A pod that ended: no longer listed (unprepare its claims as the kubelet would)."""
        self.pod_claims.pop((namespace, pod), None)

    def dynamic_resources(self, namespace: str, pod: str, container: str) -> list[Any]:
        """PodResources' DynamicResource entries of one container: per claim it names, each prepared
        device with driver, pool and device name, its share, and CDI devices as the kubelet fills
        them, from one list per driver that it does not reset between devices (GetDynamicResources
        in kubernetes/kubernetes pkg/kubelet/cm/container_manager_linux.go): a claim's second
        device of a driver carries the first one's CDI devices too."""
        entries = []
        for claim_namespace, claim_name, uid in self.pod_claims.get((namespace, pod), {}).get(container, []):
            results = []
            for driver, devices in self.prepared.get(uid, {}).items():
                cdi: list[Any] = []
                for device in devices:
                    cdi += [podresourcespb.CDIDevice(name=cdi_id) for cdi_id in device.cdi_device_ids]
                    result = podresourcespb.ClaimResource(
                        cdi_devices=cdi, driver_name=driver, pool_name=device.pool_name, device_name=device.device_name
                    )
                    if device.HasField("share_id"):
                        result.share_id = device.share_id
                    results.append(result)
            entries.append(
                podresourcespb.DynamicResource(
                    claim_name=claim_name, claim_namespace=claim_namespace, claim_resources=results
                )
            )
        return entries

    async def unprepare(self, driver: str, claims: Iterable[tuple[str, str, str]]) -> Any:
        """NodeUnprepareResources for (namespace, uid, name) claims; the response. A claim
        unprepared without error is forgotten for ``cdi_devices``."""
        response = await self._call(driver, "NodeUnprepareResources", drapb.NodeUnprepareResourcesRequest, claims)
        for uid, answer in response.claims.items():
            if not answer.error:
                self._marked.discard(uid)
            if not answer.error and uid in self.prepared:
                self.prepared[uid].pop(driver, None)
                if not self.prepared[uid]:
                    del self.prepared[uid]
        return response

    @asynccontextmanager
    async def watch_health(self, driver: str) -> AsyncIterator[AsyncIterator[Any]]:
        """The NodeWatchResources stream, as the kubelet opens it to a registered driver: in the
        first of ``health_versions`` (this kubelet's, newest first) that the driver lists
        (kubelets from 1.37 ask that; older ones open v1alpha1 regardless). The path it opened is
        appended to ``health_paths``."""
        known = self._driver(driver)
        chosen = next((v for v in self.health_versions if v in known.supported_versions), None)
        if chosen is None:
            spoken = ", ".join(self.health_versions)
            raise RPCError(StatusCode.FAILED_PRECONDITION, f"DRA driver {driver} lists none of {spoken}")
        path = f"/{chosen}/NodeWatchResources"
        self.health_paths.append(path)
        method, request = DRA_METHODS[path], drahealth.NodeWatchResourcesRequest()
        async with open_stream(known.endpoint, method, request, timeout=DRA_KUBELET_TIMEOUT) as responses:
            yield responses

    def _driver(self, driver: str) -> SimulatedDriver:
        """The plugin a call goes to: the newest connected one, else the newest (DRAPluginManager.get),
        whose channel the call connects again."""
        plugins = self.plugins.get(driver)
        if not plugins:
            raise RPCError(StatusCode.FAILED_PRECONDITION, f"DRA driver {driver} is not registered")
        chosen = next((p for p in reversed(plugins) if p.connected), plugins[-1])
        if not chosen.connected and self._connections is not None and not self._restart.is_set():  # (closing)
            chosen.connection = trio.CancelScope()
            self._connections.start_soon(functools.partial(self._connect, chosen, task_status=trio.TASK_STATUS_IGNORED))
        return chosen

    async def _call(self, driver: str, method: str, request_type: Any, claims: Iterable[tuple[str, str, str]]) -> Any:
        known = self._driver(driver)
        request = request_type(claims=[drapb.Claim(namespace=n, uid=u, name=m) for n, u, m in claims])
        path = f"/{known.service}/{method}"
        return await call_unary(known.endpoint, DRA_METHODS[path], request, timeout=DRA_KUBELET_TIMEOUT)


class PodResourcesSimulator:
    """The kubelet's PodResources API on a socket of your choice, answered from the kubelet
    stand-ins' books as the kubelet answers from its device and DRA managers (kubernetes/kubernetes
    pkg/kubelet/apis/podresources/server_v1.go): List, Get, GetAllocatableResources. ``calls``
    lists the method of each call answered. ``await nursery.start(simulator.run)``.
    Lenient: no rate limit; gopherplug_standins.PodResourcesSimulator adds the kubelet's."""

    def __init__(
        self, socket_path: str, kubelet: KubeletSimulator | None = None, dra_kubelet: DraKubeletSimulator | None = None
    ) -> None:
        self.socket_path = socket_path
        self.kubelet, self.dra_kubelet = kubelet, dra_kubelet
        self.calls: list[str] = []  #: "List", "Get" or "GetAllocatableResources", per call answered

    async def run(self, *, task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
        os.makedirs(os.path.dirname(self.socket_path), exist_ok=True)
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_grpc, self.socket_path, [self._service()])
            task_status.started(self)

    def pods(self) -> list[Any]:
        """What List answers: every pod either kubelet stand-in knows, in the order they came."""
        books: dict[tuple[str, str], set[str]] = {}
        for known in (self.kubelet and self.kubelet.pod_devices, self.dra_kubelet and self.dra_kubelet.pod_claims):
            for pod, containers in (known or {}).items():
                books.setdefault(pod, set()).update(containers)
        return [self._pod(namespace, pod, sorted(containers)) for (namespace, pod), containers in books.items()]

    def _pod(self, namespace: str, pod: str, containers: Iterable[str]) -> Any:
        answer = podresourcespb.PodResources(name=pod, namespace=namespace)
        for name in containers:
            held = (self.kubelet.pod_devices if self.kubelet else {}).get((namespace, pod), {}).get(name, {})
            answer.containers.add(
                name=name,
                devices=[podresourcespb.ContainerDevices(resource_name=r, device_ids=ids) for r, ids in held.items()],
                dynamic_resources=self.dra_kubelet.dynamic_resources(namespace, pod, name) if self.dra_kubelet else [],
            )
        return answer

    async def _admit(self, method: str) -> None:
        """Before each call: raise RPCError to refuse it; nothing here (the strict one rate-limits)."""

    def _service(self) -> purerpc.Service:
        async def list_(request: Any) -> Any:
            await self._answering("List")
            return podresourcespb.ListPodResourcesResponse(pod_resources=self.pods())

        async def get(request: Any) -> Any:
            await self._answering("Get")
            for pod in self.pods():
                if (pod.namespace, pod.name) == (request.pod_namespace, request.pod_name):
                    return podresourcespb.GetPodResourcesResponse(pod_resources=pod)
            # The kubelet's words, through a plain Go error: grpc-go sends it with code UNKNOWN.
            raise RPCError(StatusCode.UNKNOWN, f"pod {request.pod_name} in namespace {request.pod_namespace} not found")

        async def allocatable(request: Any) -> Any:
            await self._answering("GetAllocatableResources")
            resources = self.kubelet.resources if self.kubelet else {}
            return podresourcespb.AllocatableResourcesResponse(
                devices=[
                    podresourcespb.ContainerDevices(resource_name=name, device_ids=[device_id])
                    for name, resource in resources.items()
                    for device_id, health in resource.devices.items()
                    if health == HEALTHY
                ]
            )

        service = purerpc.Service(f"{_PODRESOURCES_PACKAGE}.PodResourcesLister")
        for name, handler in (("List", list_), ("Get", get), ("GetAllocatableResources", allocatable)):
            service.add_method(name, handler, PODRESOURCES_METHODS[f"/{service.name}/{name}"].signature)
        return service

    async def _answering(self, method: str) -> None:
        await self._admit(method)
        self.calls.append(method)


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    """A meta/v1 Status, the API server's error document."""
    status = "Failure" if code >= 400 else "Success"
    return {"kind": "Status", "apiVersion": "v1", "status": status, "message": message, "reason": reason, "code": code}


def go_json(document: Any) -> bytes:
    """``document`` as the API server writes it: Go's encoding/json, compact and in UTF-8. Go writes
    every character raw except ``"``, ``\\``, those below U+0020, U+2028, U+2029, ``<``, ``>`` and
    ``&`` (encodeState.string in Go's src/encoding/json/encode.go): U+0085 and the other line breaks
    of str.splitlines() come raw inside a watch event's line (KubeApi._watch). The characters Go
    escapes appear in JSON only inside strings: escaping them in the whole text is enough."""
    text = json.dumps(document, ensure_ascii=False, separators=(",", ":"))
    for char in "<>&\u2028\u2029":
        text = text.replace(char, f"\\u{ord(char):04x}")
    return text.encode()


#: One HTTP/1.1 connection LenientApiServer answers on: (h11's state of it, its byte stream, the h11 module).
_Http = tuple[Any, Any, Any]


class LenientApiServer:
    """The few requests of a DRA driver, served over HTTP/1.1 on 127.0.0.1, and nothing checked.

    It holds Nodes (``put_node``), ResourceClaims as the scheduler left them (``put_claim``) and
    the ResourceSlices the driver writes (``slices``, by name; ``writes`` lists each write), and
    answers what a driver asks as the real one does: GET a Node or a claim; list and watch Nodes
    and slices by field selectors; server-side apply of a claim's status.devices
    (``status_writes``); create, update (409 for a stale resourceVersion) and delete slices. Every
    write touches ``changed``.

    Lenient: it stores whatever it is given, enough for ``gopherplug demo --dra``. Tests need the
    strict stand-in, gopherplug_standins.ApiServerSimulator, which refuses what the real API server
    refuses, checks tokens, speaks TLS, fails on demand and ends watches, through the hooks below.
    Needs h11 (the `dra` extra brings it)."""

    PREFIX = "/apis/resource.k8s.io/v1"

    def __init__(self) -> None:
        self.claims: dict[tuple[str, str], dict[str, Any]] = {}
        self.nodes: dict[str, dict[str, Any]] = {}  #: Node objects by name (put_node)
        self.slices: dict[str, dict[str, Any]] = {}
        self.writes: list[tuple[str, str]] = []  #: (verb, slice name), in order
        #: (namespace, claim name, field manager) of each status.devices applied, in order
        self.status_writes: list[tuple[str, str, str]] = []
        self._status_owners: dict[tuple[str, str], dict[tuple[str, str, str, str], str]] = {}
        self.port = 0
        self._version = 0
        self._events: list[tuple[int, str, str, dict[str, Any]]] = []  # (version, resource, type, object)
        self.changed = Watched(None)  #: touched at every write

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def run(self, *, task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
        tcp = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = tcp[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(trio.serve_listeners, self._connection, self._listeners(tcp)))
            task_status.started(self)

    def put_claim(self, claim: dict[str, Any]) -> None:
        """Store a claim as the scheduler left it (allocated, in status.allocation)."""
        metadata = claim["metadata"]
        self.claims[metadata["namespace"], metadata["name"]] = claim

    def put_node(
        self,
        name: str,
        uid: str,
        allocatable: Mapping[str, str] | None = None,
        annotations: Mapping[str, str] | None = None,
    ) -> None:
        """A Node, as the kubelet registers it: what a slice's owner reference names. ``allocatable``:
        its status.allocatable (KubeletSimulator.allocatable()); None: no status. ``annotations``:
        its metadata.annotations (any text at all)."""
        self._put_node(name, uid, {} if allocatable is None else {"allocatable": dict(allocatable)}, annotations)

    def _put_node(
        self, name: str, uid: str, status: Mapping[str, Any], annotations: Mapping[str, str] | None = None
    ) -> None:
        """Store a Node with this status ({}: none) and annotations, and its watch event."""
        node: dict[str, Any] = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "uid": uid}}
        if annotations:
            node["metadata"]["annotations"] = dict(annotations)
        if status:
            node["status"] = dict(status)
        self.nodes[name] = self._bump("MODIFIED" if name in self.nodes else "ADDED", node, "nodes")

    def delete_slice(self, name: str) -> None:
        """Delete a slice as someone else would (an administrator, the kubelet's cleanup)."""
        self._bump("DELETED", self.slices.pop(name))

    def delete_node_slices(self, node_name: str, driver: str = "") -> None:
        """What the kubelet's wipe does: DeleteCollection with field selectors spec.nodeName and,
        unless "", spec.driver."""
        for name, item in list(self.slices.items()):
            if item["spec"].get("nodeName") == node_name and driver in ("", item["spec"]["driver"]):
                self.delete_slice(name)

    # The hooks: what the strict stand-in adds, a no-op here.

    def _listeners(self, tcp: list[trio.SocketListener]) -> list[Any]:
        """The listeners to serve on: plain TCP here (the strict one may wrap them in TLS)."""
        return list(tcp)

    async def _refuse(self, http: _Http, request: Any, headers: Mapping[str, str]) -> bool:
        """Answer a request before it is routed, and say so (authentication); none here."""
        return False

    async def _intercept(self, http: _Http, verb: str, name: str) -> bool:
        """Answer a write ("create", "update", "delete", "status") instead of doing it, and say so; none here."""
        return False

    def _check_slice(self, item: dict[str, Any], old: Mapping[str, Any] | None) -> dict[str, Any] | None:
        """Change a slice about to be stored as the server would, or refuse it with the Status to
        answer (422); neither here."""
        return None

    def _check_claim_status(self, claim: Mapping[str, Any], devices: list[Mapping[str, Any]]) -> dict[str, Any] | None:
        """Refuse a claim's status.devices about to be stored with the Status to answer; never here."""
        return None

    def _written(self, verb: str, name: str, status: int) -> None:
        """A slice write done, with the status answered."""
        self.writes.append((verb, name))

    async def _hold(self) -> bool:
        """Before each answer: True closes the connection without one (a server going down)."""
        return False

    # HTTP, one request after another on each connection (h11 keeps HTTP/1.1's state).

    def _bump(self, kind: str, item: dict[str, Any], resource: str = "resourceslices") -> dict[str, Any]:
        self._version += 1
        item = json.loads(json.dumps(item))
        item["metadata"]["resourceVersion"] = str(self._version)
        self._events.append((self._version, resource, kind, item))
        self.changed.touch()
        return item

    async def _connection(self, stream: Any) -> None:
        import h11  # only the DRA tests and demo need it: the dra extra brings it

        connection = h11.Connection(h11.SERVER)
        http = (connection, stream, h11)
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, h11.RemoteProtocolError):
            async with stream:
                while True:
                    request, body = await self._read_request(http)
                    if request is None or await self._hold():
                        return
                    await self._answer(http, request, body)
                    if connection.our_state is not h11.DONE:
                        return  # a watch that ended with the server going down, or a must-close
                    connection.start_next_cycle()

    async def _read_request(self, http: _Http) -> tuple[Any, bytes]:
        connection, stream, h11 = http
        request, body = None, b""
        while True:
            event = connection.next_event()
            if event is h11.NEED_DATA:
                data = await stream.receive_some(65536)
                connection.receive_data(data)
                if not data and request is None:
                    return None, b""
            elif isinstance(event, h11.Request):
                request = event
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                return request, body
            elif isinstance(event, h11.ConnectionClosed):
                return None, b""

    async def _send(self, http: _Http, status: int, document: Any, extra: Iterable[tuple[str, str]] = ()) -> None:
        connection, stream, h11 = http
        data = go_json(document)
        headers = [("content-type", "application/json"), ("content-length", str(len(data))), *extra]
        await stream.send_all(connection.send(h11.Response(status_code=status, headers=headers)))
        await stream.send_all(connection.send(h11.Data(data=data)) + connection.send(h11.EndOfMessage()))

    async def _not_found(self, http: _Http, message: str) -> None:
        await self._send(http, 404, _status(404, "NotFound", message))

    async def _answer(self, http: _Http, request: Any, body: bytes) -> None:
        headers = {name.decode().lower(): value.decode() for name, value in request.headers}
        if await self._refuse(http, request, headers):
            return
        url = urllib.parse.urlsplit(request.target.decode())
        query = dict(urllib.parse.parse_qsl(url.query))
        method, path = request.method.decode(), url.path
        if method == "GET" and path == "/api/v1/nodes":
            await self._answer_nodes(http, query)
            return
        if method == "GET" and path.startswith("/api/v1/nodes/"):
            name = path.removeprefix("/api/v1/nodes/")
            if (node := self.nodes.get(name)) is None:
                await self._not_found(http, f'nodes "{name}" not found')
            else:
                await self._send(http, 200, node)
            return
        parts = path.removeprefix(self.PREFIX).strip("/").split("/")
        if method == "PATCH" and len(parts) == 5 and parts[2] == "resourceclaims" and parts[4] == "status":
            await self._apply_claim_status(http, parts[1], parts[3], headers, query, body)
            return
        if method == "GET" and len(parts) == 4 and parts[0] == "namespaces" and parts[2] == "resourceclaims":
            if (claim := self.claims.get((parts[1], parts[3]))) is None:
                await self._not_found(http, f"resourceclaims {parts[3]!r} not found")
            else:
                await self._send(http, 200, claim)
            return
        if parts[0] != "resourceslices":
            await self._not_found(http, f"no route for {method} {path}")
            return
        await self._answer_slices(http, method, parts, query, body)

    async def _answer_nodes(self, http: _Http, query: Mapping[str, str]) -> None:
        """List or watch Nodes, narrowed by a metadata.name field selector if there is one."""
        selected = dict(pair.split("=", 1) for pair in query.get("fieldSelector", "").split(",") if "=" in pair)

        def matches(item: dict[str, Any]) -> bool:
            return bool(selected.get("metadata.name", item["metadata"]["name"]) == item["metadata"]["name"])

        if query.get("watch") in ("true", "1"):
            await self._watch(http, "nodes", query, matches)
            return
        items = [item for item in self.nodes.values() if matches(item)]
        listed = {"kind": "NodeList", "apiVersion": "v1", "metadata": {"resourceVersion": str(self._version)}}
        await self._send(http, 200, {**listed, "items": items})

    async def _answer_slices(
        self, http: _Http, method: str, parts: list[str], query: Mapping[str, str], body: bytes
    ) -> None:
        selected = dict(pair.split("=", 1) for pair in query.get("fieldSelector", "").split(",") if "=" in pair)

        def matches(item: dict[str, Any]) -> bool:
            spec = item["spec"]
            return all(spec.get(key.removeprefix("spec.")) == value for key, value in selected.items())

        if method == "GET" and len(parts) == 1 and query.get("watch") in ("true", "1"):
            await self._watch(http, "resourceslices", query, matches)
            return
        if method == "GET" and len(parts) == 1:
            items = [item for item in self.slices.values() if matches(item)]
            meta = {"resourceVersion": str(self._version)}
            listed = {"kind": "ResourceSliceList", "apiVersion": "resource.k8s.io/v1", "metadata": meta, "items": items}
            await self._send(http, 200, listed)
            return
        verb = {"POST": "create", "PUT": "update", "DELETE": "delete"}.get(method)
        name = parts[1] if len(parts) == 2 else json.loads(body)["metadata"]["name"] if verb == "create" else ""
        if verb is None or (verb == "create") != (len(parts) == 1) or len(parts) > 2:
            await self._not_found(http, f"{method} {self.PREFIX}/{'/'.join(parts)}: not found")
        elif await self._intercept(http, verb, name):
            return
        elif verb == "create":
            item = json.loads(body)
            if (refusal := self._check_slice(item, None)) is not None:
                await self._send(http, refusal["code"], refusal)
            elif name in self.slices:
                await self._send(http, 409, _status(409, "AlreadyExists", f"{name} already exists"))
            else:
                self.slices[name] = self._bump("ADDED", item)
                self._written("create", name, 201)
                await self._send(http, 201, self.slices[name])
        elif name not in self.slices:
            await self._not_found(http, f"{name} not found")
        elif verb == "update":
            item = json.loads(body)
            if item["metadata"].get("resourceVersion") != self.slices[name]["metadata"]["resourceVersion"]:
                await self._send(http, 409, _status(409, "Conflict", f"{name} was modified"))
            elif (refusal := self._check_slice(item, self.slices[name])) is not None:
                await self._send(http, refusal["code"], refusal)
            else:
                self.slices[name] = self._bump("MODIFIED", item)
                self._written("update", name, 200)
                await self._send(http, 200, self.slices[name])
        else:
            self._bump("DELETED", self.slices.pop(name))
            self._written("delete", name, 200)
            await self._send(http, 200, _status(200, "Success", "deleted"))

    async def _apply_claim_status(
        self, http: _Http, namespace: str, name: str, headers: Mapping[str, str], query: Mapping[str, str], body: bytes
    ) -> None:
        """Server-side apply to a claim's status subresource (415 for another patch type, 404 for no
        such claim, 409 for another UID): the field manager's entries replace those it applied before."""
        if await self._intercept(http, "status", name):
            return
        if headers.get("content-type", "").split(";")[0] != "application/apply-patch+yaml":
            await self._send(http, 415, _status(415, "UnsupportedMediaType", "not an apply patch"))
            return
        manager = query.get("fieldManager", "")
        claim = self.claims.get((namespace, name))
        applied = json.loads(body)
        if claim is None:
            await self._not_found(http, f'resourceclaims "{name}" not found')
            return
        uid = (applied.get("metadata") or {}).get("uid")
        if uid is not None and uid != claim["metadata"]["uid"]:
            message = f"Precondition failed: UID in precondition: {uid}, UID in object meta: {claim['metadata']['uid']}"
            await self._send(http, 409, _status(409, "Conflict", message))
            return
        devices = (applied.get("status") or {}).get("devices") or []
        # (driver, pool, device, shareID) -> manager: the list map's keys
        owners = self._status_owners.setdefault((namespace, name), {})
        kept = [
            entry
            for entry in (claim.get("status") or {}).get("devices") or []
            if owners.get((entry["driver"], entry["pool"], entry["device"], entry.get("shareID", ""))) != manager
        ]
        new = [*kept, *devices]
        if (refusal := self._check_claim_status(claim, new)) is not None:
            await self._send(http, refusal["code"], refusal)
            return
        claim.setdefault("status", {})["devices"] = new
        for entry in devices:
            owners[entry["driver"], entry["pool"], entry["device"], entry.get("shareID", "")] = manager
        self.status_writes.append((namespace, name, manager))
        self.changed.touch()
        await self._send(http, 200, claim)

    async def _start_watch(self, http: _Http) -> None:
        connection, stream, h11 = http
        headers = [("content-type", "application/json"), ("transfer-encoding", "chunked")]
        await stream.send_all(connection.send(h11.Response(status_code=200, headers=headers)))

    async def _send_events(self, http: _Http, resource: str, since: int, matches: Callable[[Any], bool]) -> int:
        """Send a watch every event of ``resource`` after resourceVersion ``since`` that it selects;
        the newest version."""
        connection, stream, h11 = http
        for version, of, kind, item in self._events:
            if version > since and of == resource and matches(item):
                line = go_json({"type": kind, "object": item}) + b"\n"
                await stream.send_all(connection.send(h11.Data(data=line)))
            since = max(since, version)
        return since

    async def _watch(
        self, http: _Http, resource: str, query: Mapping[str, str], matches: Callable[[Any], bool]
    ) -> None:
        """Stream the events of ``resource`` that ``matches`` selects after the query's
        resourceVersion, for ever: no bookmarks, no end (the strict stand-in has both)."""
        await self._start_watch(http)
        since = int(query.get("resourceVersion") or 0)
        while True:
            changed = self.changed.next_touch()
            since = await self._send_events(http, resource, since, matches)
            await changed.wait()


DEMO_DRA_CONFIG = """\
# The DRA demo's configuration: every file in the temporary directory is one gopher device,
# offered through DRA only; a container gets it as a CDI device (a mount and an env var).
device_plugin_dir: {root}/device-plugins
dra:
  driver: gopherplug.example.com
  kubelet_dir: {root}/kubelet
resources:
  - name: example.com/gopher
    directory: {root}/gophers
    api: dra
    env: GOPHER
    mounts:
      - host_path: "{{path}}"
        container_path: /run/gophers/{{id}}
    cdi: {{kind: example.com/gopher, spec_dir: {root}/cdi}}
"""


def _demo_needs_dra_extra(what: str) -> None:
    try:  # before anything starts: the API server simulator needs h11, the client lightkube
        import h11  # noqa: F401

        _import_api_client()
    except ImportError as error:
        why = f"{what} needs the dra extra ({error}): pip install '.[dra]' in a checkout of gopherplug"
        raise GopherplugError(why) from None


@contextlib.asynccontextmanager
async def _demo_dra_side(
    nursery: trio.Nursery, kubelet_dir: str, root: str, node: str, say: Callable[[str, str], None]
) -> AsyncIterator[tuple[LenientApiServer, DraKubeletSimulator, Any]]:
    """The API server simulator (with ``node``, the slices' owner) and the DRA kubelet simulator,
    started in ``nursery``, and the plugin's API client through a kubeconfig in ``root``, closed
    after (once the plugin, in a nursery of its own inside, has stopped, part by part)."""
    api = await nursery.start(LenientApiServer().run)
    api.put_node(node, f"5e0f1c2a-{node}")  # the kubelet registered it
    say("apiserver", f"serving resource.k8s.io/v1 on {api.url}")
    kubelet = DraKubeletSimulator(kubelet_dir, wipe=functools.partial(api.delete_node_slices, node))
    await nursery.start(kubelet.run)
    users, clusters = [{"name": "demo", "user": {}}], [{"name": "demo", "cluster": {"server": api.url}}]
    context = {"name": "demo", "context": {"cluster": "demo", "user": "demo"}}
    document = {"apiVersion": "v1", "kind": "Config", "current-context": "demo", "contexts": [context]}
    document |= {"clusters": clusters, "users": users}
    with open(kubeconfig := os.path.join(root, "kubeconfig"), "w", encoding="utf-8") as file:
        yaml.safe_dump(document, file)
    client = KubeApi.connect(kubeconfig=kubeconfig, node_name=node)
    try:
        yield api, kubelet, client
    finally:
        await client.aclose()


async def run_dra_demo(out: Callable[[str], None] = print) -> None:
    """The DRA flow, narrated: the plugin as a DRA driver between a simulated kubelet and a
    simulated API server, in a temporary directory it leaves behind as it found it (gone)."""
    _demo_needs_dra_extra("the DRA demo")
    with _demo_root("gopherplug-dra-demo-", "gopherplug.example.com") as root:
        for directory in ("device-plugins", "kubelet", "gophers"):
            os.mkdir(os.path.join(root, directory))
        for name in ("gopher0", "gopher1", "gopher2"):
            open(os.path.join(root, "gophers", name), "x").close()
        config = parse_config(DEMO_DRA_CONFIG.format(root=root), "<demo>")
        await _narrate_dra_demo(config, root, out)


async def _narrate_dra_demo(config: Config, root: str, out: Callable[[str], None]) -> None:
    assert config.dra is not None
    driver, resource, node = config.dra.driver, config.resources[0], "demo-node"
    pool = dra_pool_name(node, resource.name)
    say = _demo_clock(out, width=9)

    async def api_until(done: Callable[[], bool]) -> None:
        while not done():
            await api.changed.wait_touched()

    def slices() -> list[dict[str, Any]]:
        return [item for item in api.slices.values() if item["spec"]["pool"]["name"] == pool]

    def devices_in_slices() -> list[str]:
        return sorted((d["name"] for item in slices() for d in item["spec"]["devices"]), key=_natural_key)

    def slice_line() -> str:
        (item,) = slices()
        generation = item["spec"]["pool"]["generation"]
        return f"ResourceSlice {item['metadata']['name']}: pool {pool} generation {generation}, " + (
            f"devices {', '.join(devices_in_slices())}"
        )

    out(f"gopherplug demo --dra: a simulated kubelet and API server, and the real plugin, in {root}")
    async with trio.open_nursery() as nursery:
        async with _demo_dra_side(nursery, config.dra.kubelet_dir, root, node, say) as (api, kubelet, client):
            say("kubelet", f"watching {kubelet.registry} for registration sockets; this node's slices wiped")
            async with trio.open_nursery() as plugin:
                await plugin.start(functools.partial(serve_plugin, config, node_name=node, api=client))
                say("plugin", f"watching {resource.sources[0].directory}; serving {config.dra.registration_socket}")
                await _demo_step("registration", kubelet.wait_until(lambda k: driver in k.drivers))
                known = kubelet.drivers[driver]
                say("kubelet", f"GetInfo: type {DRA_PLUGIN_TYPE}, name {driver}, endpoint {known.endpoint}")
                say("kubelet", f"  supported versions {', '.join(known.supported_versions)}: chose {known.service}")
                say("kubelet", "NotifyRegistrationStatus(registered): the driver is known to this node")
                await _demo_step("the first ResourceSlice", api_until(lambda: len(devices_in_slices()) == 3))
                say("plugin", slice_line())
                first = slices()[0]["spec"]["devices"][0]
                attributes = ", ".join(f"{k}={next(iter(v.values()))}" for k, v in first["attributes"].items())
                say("plugin", f"  device {first['name']}: {attributes}")
                async with kubelet.watch_health(driver) as reports:
                    report = await reports.__anext__()
                health = ", ".join(f"{d.device.device_name} {drahealth.NAMES[d.health]}" for d in report.devices)
                say("plugin", f"NodeWatchResources: {health} (again at each change, and every {DRA_HEALTH_RESEND:g} s)")

                added = os.path.join(resource.sources[0].directory, "gopher3")
                open(added, "x").close()
                touched = trio.current_time()
                say("demo", f"created {added}")
                await _demo_step("the slice's update", api_until(lambda: "gopher3" in devices_in_slices()))
                say("plugin", f"{slice_line()} ({(trio.current_time() - touched) * 1e3:.1f} ms later)")

                # What the scheduler does, in one line: it picks a device that the claim's DeviceClass
                # selects by CEL and writes the result into the claim's status.allocation.
                results = [{"request": "gopher", "driver": driver, "pool": pool, "device": "gopher1"}]
                api.put_claim(_demo_allocated_claim("my-gopher", "7f3e-demo", "gopher", "gopher", results))
                say("scheduler", f"allocated ResourceClaim default/my-gopher: device gopher1 of pool {pool}")
                answer = (await kubelet.prepare(driver, [("default", "7f3e-demo", "my-gopher")])).claims["7f3e-demo"]
                say("kubelet", "NodePrepareResources(default/my-gopher, uid 7f3e-demo)")
                for device in answer.devices:
                    say("plugin", f"  {device.device_name}: CDI device {', '.join(device.cdi_device_ids)}")
                assert resource.cdi is not None
                with open(resource.cdi.spec_file, encoding="utf-8") as file:
                    spec = json.load(file)
                edits = next(d["containerEdits"] for d in spec["devices"] if d["name"] == "gopher1")
                say("runtime", f"{resource.cdi.spec_file}: gopher1 is")
                for env in edits.get("env", []):
                    say("runtime", f"  env {env}")
                for mount in edits.get("mounts", []):
                    options = ",".join(mount["options"])
                    say("runtime", f"  mount {mount['hostPath']} -> {mount['containerPath']} ({options})")
                # The request's own CDI device, in the claim's spec: the env Allocate would give.
                own = ClaimCDISpec(resource.cdi.kind, resource.cdi.spec_dir, "7f3e-demo")
                with open(own.spec_file, encoding="utf-8") as file:
                    [described] = json.load(file)["devices"]
                env = ", ".join(described["containerEdits"]["env"])
                say("runtime", f"{own.kind}={described['name']} is request gopher's env, as Allocate gives it: {env}")
                metadata = ClaimCDISpec(dra_metadata_cdi_kind(driver), resource.cdi.spec_dir, "7f3e-demo")
                if os.path.exists(metadata.spec_file):  # dra.device_metadata, on by default
                    with open(metadata.spec_file, encoding="utf-8") as file:
                        [described] = json.load(file)["devices"]
                    say("runtime", f"{metadata.kind}={described['name']} is the claim's device metadata (KEP-5304):")
                    for mount in described["containerEdits"]["mounts"]:
                        options = ",".join(mount["options"])
                        say("runtime", f"  mount {mount['hostPath']} -> {mount['containerPath']} ({options})")
                kubelet.use_claims("default", "my-pod", "app", [("default", "my-gopher", "7f3e-demo")])
                socket_path = os.path.join(config.dra.kubelet_dir, POD_RESOURCES_SOCKET)
                await nursery.start(PodResourcesSimulator(socket_path, None, kubelet).run)
                scanned = [(r, scan_directory(r).devices) for r in config.resources]
                held = device_holders(scanned, await list_pod_resources(socket_path), driver, node)
                for line in who_report(held).splitlines():
                    say("who", line.replace(resource.sources[0].directory + os.sep, ""))
                kubelet.remove_pod("default", "my-pod")
                await kubelet.unprepare(driver, [("default", "7f3e-demo", "my-gopher")])
                say("kubelet", "NodeUnprepareResources(default/my-gopher): the pod is gone; checkpoint updated")

                restarted = trio.current_time()
                kubelet.restart()
                say("kubelet", "restarted: it wipes this node's slices, then walks plugins_registry again")
                await _demo_step("registration", kubelet.wait_until(lambda k: k.starts == 2 and driver in k.drivers))
                await _demo_step("the slices", api_until(lambda: len(devices_in_slices()) == 4))
                elapsed = (trio.current_time() - restarted) * 1e3
                say("plugin", f"registered again; saw its slices deleted and wrote them again: {elapsed:.1f} ms")
                say("plugin", slice_line())
                plugin.cancel_scope.cancel()
        nursery.cancel_scope.cancel()  # the API server and the kubelet
    say("demo", "done: plugin stopped, its sockets removed")


# `gopherplug demo --config FILE [--dra]`: the user's own configuration against the same simulators.
#: The driver a configuration without ``dra`` gets under ``demo --dra``.
DEMO_DRIVER = "gopherplug.example.com"
#: The node the DRA demos name their pools after.
DEMO_NODE = "demo-node"
#: A device list longer than this is shown cut, with how many more there are.
DEMO_LIST_LENGTH = 12


def load_demo_config(path: str, dra: bool = False) -> Config:
    """The configuration file at ``path`` for ``demo --config``, refused as check-config refuses it.
    With ``dra``, every resource is served through DRA (``api: dra``; ``dra: {driver:
    gopherplug.example.com}`` where the file has no ``dra``): an option DRA has not (``replicas``
    under the device plugin's ``preferred``, ``annotations``, ``pre_start``) is refused in one line
    that says so."""
    config = load_config(path)
    if not dra or all(resource.dra for resource in config.resources):
        return config
    with open(path, encoding="utf-8") as file:
        data = yaml.safe_load(file)  # valid: load_config read it
    data["dra"] = data.get("dra") or {"driver": DEMO_DRIVER}
    for resource in data["resources"]:
        resource["api"] = "dra"
    try:
        return parse_config(yaml.safe_dump(data), path)
    except ConfigError as error:
        raise ConfigError(error.source, error.key_path, f"{error.problem} (demo --dra serves it through DRA)") from None


#: `demo --select`: a CEL selector's text, whether it selects a device of the demo's driver (a
#: ResourceSlice's device), and the error it raises instead with the scheduler's words (CELError).
DemoSelector = tuple[str, Callable[[Mapping[str, Any]], bool], type[Exception]]


def demo_selector(expression: str, driver: str) -> DemoSelector:
    """``expression`` compiled for ``demo --select`` as the scheduler evaluates it (gopherplug_cel's
    DeviceSelector, with cel-python and the Kubernetes CEL library's quantity and semver functions):
    GopherplugError, before anything starts, when it cannot be (a syntax error, which the API server
    refuses too; the cel extra missing)."""
    try:  # here, not above: a node running this module has neither gopherplug_cel nor cel-python
        from gopherplug_cel import CELError, DeviceSelector, cel_device

        selector = DeviceSelector(expression)
    except CELError as error:  # as the API server refuses a ResourceClaim or DeviceClass with it
        raise GopherplugError(f"{error} (the API server would refuse a claim with it)") from None
    except ImportError as error:
        raise GopherplugError(f"CEL needs the cel extra ({error}): pip install '.[dra,cel]' in a checkout") from None
    return expression, lambda device: selector.matches(cel_device(driver, device)), CELError


def demo_selectors(values: Iterable[str], config: Config) -> dict[str, DemoSelector]:
    """`demo --select`'s values by resource: RESOURCE=CEL, or a bare CEL where the file has one resource."""
    names, selectors = [r.name for r in config.resources], {}
    for value in values:
        named = re.match(r"([\w.-]+/[\w.-]+)=(?!=)", value)  # not a CEL: the = of a name, and no ==
        name, expression = (named[1], value[named.end() :]) if named else (names[0] if len(names) == 1 else "", value)
        if name not in names or name in selectors:  # one CEL for all would fail the claims it does not fit
            listed = ", ".join(names)
            why = "is given twice" if name in selectors else f"is no resource of the file ({listed})"
            raise GopherplugError(f"{name} {why}" if name else f"which resource? write RESOURCE=CEL, one of {listed}")
        selectors[name] = demo_selector(expression, config.dra.driver)  # type: ignore[union-attr]
    return selectors


def _demo_config(config: Config, root: str) -> Config:
    """``config`` as the demo runs it: the devices where the file says (what the demo is about),
    everything the plugin would write or serve moved into ``root`` (the kubelet's directories, the
    CDI specs), and no metrics or liveness server."""
    resources = tuple(
        dataclasses.replace(r, cdi=dataclasses.replace(r.cdi, spec_dir=os.path.join(root, "cdi"))) if r.cdi else r
        for r in config.resources
    )
    dra = config.dra and dataclasses.replace(config.dra, kubelet_dir=os.path.join(root, "kubelet"), pod_uid="")
    plugins = os.path.join(root, "device-plugins")
    return dataclasses.replace(
        config, resources=resources, dra=dra, device_plugin_dir=plugins, metrics_address=None, health_address=None
    )


async def run_config_demo(
    config: Config, out: Callable[[str], None] = print, select: Mapping[str, DemoSelector] | None = None
) -> None:
    """``config``'s resources, scanned where the file says, served by the real plugin to the simulated
    kubelet (and, for ``api: dra``, to the simulated DRA kubelet and API server) in a temporary
    directory: each registration and first list or ResourceSlice, then one Allocate or one prepared
    claim per resource (for a device ``select`` selects, each device's verdict said), narrated.
    Leaves nothing behind."""
    if config.dra is not None:
        _demo_needs_dra_extra("a DRA resource")
    with _demo_root("gopherplug-demo-", config.dra.driver if config.dra else "") as root:
        await _narrate_config_demo(_demo_config(config, root), config.source, root, out, select)


async def _narrate_config_demo(
    config: Config, source: str, root: str, out: Callable[[str], None], select: Mapping[str, DemoSelector] | None
) -> None:
    say = _demo_clock(out, width=9)
    assert config.device_plugin_dir is not None
    kubelet: KubeletSimulator | None = None
    who = "kubelet and API server" if config.dra else "kubelet"
    out(f"gopherplug demo --config {source}: your configuration, the real plugin and a simulated {who}, in {root}")
    described: dict[str, dict[str, Any]] = {}  # DRA device name -> its slice entry, with what describe says
    for resource in config.resources:
        scan = scan_directory(resource, config.sysfs_root, config.dev_root)
        healthy = sum(device.health == HEALTHY for device in scan.devices)
        say("plugin", f"{resource.name}: {_devices(len(scan.devices))}, {healthy} healthy, from {resource.origin()}")
        if resource.dra and resource.describe and scan.devices:
            described |= await _demo_describe(resource, scan, say)
    async with trio.open_nursery() as nursery:
        if any(resource.device_plugin for resource in config.resources):
            kubelet = await nursery.start(KubeletSimulator(config.device_plugin_dir).run)
            narrate = KubeletNarrator(kubelet, say)
            say("kubelet", f"serving Registration on {kubelet.socket_path}")
        dra = config.dra and _demo_dra_side(nursery, config.dra.kubelet_dir, root, DEMO_NODE, say)
        async with dra or contextlib.nullcontext((None, None, None)) as (api, dra_kubelet, client):
            if dra_kubelet is not None:
                say("kubelet", f"watching {dra_kubelet.registry} for DRA drivers")
            async with trio.open_nursery() as plugin:
                await plugin.start(functools.partial(serve_plugin, config, node_name=DEMO_NODE, api=client))
                for resource in config.resources:
                    if resource.device_plugin:  # its registration, its first list, one Allocate
                        assert kubelet is not None
                        name = resource.name
                        listed = kubelet.wait_until(lambda k: name in k.resources and k.resources[name].updates > 0)  # noqa: B023
                        await _demo_step(f"{name}'s registration and first list", listed)
                        narrate()
                        await _kubelet_allocate(kubelet, name, 1, say, "demo-pod")
                    else:
                        assert config.dra is not None and api is not None and dra_kubelet is not None
                        chosen = (select or {}).get(resource.name)
                        await _demo_claim(api, dra_kubelet, config.dra.driver, resource, described, say, chosen)
                plugin.cancel_scope.cancel()
        nursery.cancel_scope.cancel()
    say("demo", "done: plugin stopped, its sockets removed")


def _demo_allocated_claim(name: str, uid: str, request: str, device_class: str, results: list[Any]) -> dict[str, Any]:
    """A ResourceClaim in default with one request of ``device_class``, as the scheduler leaves it: allocated."""
    requests = [{"name": request, "exactly": {"deviceClassName": device_class}}]
    status = {"allocation": {"devices": {"results": results}}}
    metadata = {"namespace": "default", "name": name, "uid": uid}
    kind = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim"}
    return {**kind, "metadata": metadata, "spec": {"devices": {"requests": requests}}, "status": status}


async def _demo_describe(resource: ResourceConfig, scan: Scan, say: Callable[[str, str], None]) -> dict[str, Any]:
    """By DRA device name, ``scan``'s slice entries with what ``describe`` says, run once here as
    check-config runs it: what the plugin's own run will publish. None, with a line, if it fails."""
    try:
        said, _ = await run_describe(resource, [device.id for device in scan.devices])
    except DescribeError as error:
        say("plugin", f"{error}: the devices are published without what it says (the plugin tries again later)")
        return {}
    entries = {}
    for device in scan.devices:
        entry, _ = with_read_values(resource, device, read_declared_values(resource, device)[0], said.get(device.id))
        entries[dra_device_name(device.id)] = dra_device(resource, entry)
    return entries


async def _demo_claim(
    api: LenientApiServer,
    kubelet: DraKubeletSimulator,
    driver: str,
    resource: ResourceConfig,
    described: Mapping[str, dict[str, Any]],
    say: Callable[[str, str], None],
    select: DemoSelector | None = None,
) -> None:
    """One DRA resource: its pool's ResourceSlices (with what ``describe`` said, _demo_describe),
    then a claim for its first healthy device (that ``select`` selects), allocated as the scheduler
    would, prepared as the kubelet asks, and the CDI edits the runtime would apply for it."""
    pool = dra_pool_name(DEMO_NODE, resource.name)

    def devices() -> list[dict[str, Any]]:
        return [
            d for item in api.slices.values() if item["spec"]["pool"]["name"] == pool for d in item["spec"]["devices"]
        ]

    async def published() -> None:
        await kubelet.wait_until(lambda k: driver in k.drivers)
        while not any(item["spec"]["pool"]["name"] == pool for item in api.slices.values()):
            await api.changed.wait_touched()

    def with_values() -> bool:  # by name: a value describe says again may have changed (a temperature)
        wanted = [(d, described[d["name"]]) for d in devices() if d["name"] in described]
        return all(w[k].keys() <= d.get(k, {}).keys() for d, w in wanted for k in ("attributes", "capacity") if k in w)

    async def until_described() -> None:
        while not with_values():
            await api.changed.wait_touched()

    await _demo_step(f"{resource.name}'s ResourceSlice", published())
    say("kubelet", f"GetInfo: DRA driver {driver}, endpoint {kubelet.drivers[driver].endpoint}; registered")
    # The plugin runs describe once it has found the devices: what it says comes in the slice it
    # first writes, or in the next one.
    await _demo_step(f"the values describe gives {resource.name}'s devices", until_described())
    named = sorted((d["name"] for d in devices()), key=_natural_key)
    say("plugin", f"ResourceSlice of pool {pool}: {_named(named, DEMO_LIST_LENGTH) or 'none'}")
    claim = f"demo-{resource.name.rpartition('/')[2]}"
    if (device := _demo_pick(devices(), pool, f"default/{claim}", select, say)) is None:
        return
    # What the scheduler selects by: the device's attributes and capacity in its slice (the
    # standard ones under resource.kubernetes.io/, the others under the driver's name).
    shown = [f"{key}={next(iter(typed.values()))}" for key, typed in device["attributes"].items()]
    shown += [f"{key}={value['value']}" for key, value in device.get("capacity", {}).items()]
    say("plugin", f"  device {device['name']}: {', '.join(shown)}")
    result = {"request": "device", "driver": driver, "pool": pool, "device": device["name"]}
    if device.get("allowMultipleAllocations"):
        result["shareID"] = "00000000-0000-4000-8000-000000000000"  # the scheduler's UUID for one share
    uid = f"demo-{len(api.claims)}"
    api.put_claim(_demo_allocated_claim(claim, uid, "device", "demo", [result]))
    say("scheduler", f"allocated a ResourceClaim: device {device['name']} of pool {pool}")
    answer = (await kubelet.prepare(driver, [("default", uid, claim)])).claims[uid]
    if answer.error:
        say("plugin", f"  NodePrepareResources refused: {answer.error}")
        return
    cdi_ids = [cdi_id for prepared in answer.devices for cdi_id in prepared.cdi_device_ids]
    say("kubelet", f"NodePrepareResources: CDI devices {', '.join(cdi_ids)}")
    assert resource.cdi is not None
    for cdi_id in cdi_ids:
        kind, _, name = cdi_id.partition("=")
        edits = _demo_cdi_edits(resource.cdi.spec_dir, kind, name)
        for node in edits.get("deviceNodes", ()):
            say("runtime", f"  {cdi_id}: device {node.get('hostPath', node['path'])} -> {node['path']}")
        for mount in edits.get("mounts", ()):
            options = ",".join(mount.get("options", ()))
            say("runtime", f"  {cdi_id}: mount {mount['hostPath']} -> {mount['containerPath']} ({options})")
        for env in edits.get("env", ()):
            say("runtime", f"  {cdi_id}: env {env}")


def _demo_pick(
    devices: list[dict[str, Any]], pool: str, claim: str, select: DemoSelector | None, say: Callable[[str, str], None]
) -> dict[str, Any] | None:
    """The device the scheduler would allocate to the demo's claim: the first healthy one, in slice
    order, that ``select`` selects, each device's verdict said. The allocator evaluates the
    selectors of the devices it meets in that order, and the first CEL error fails the claim on
    this node, even where a later device would match (selectorsMatch in k8s.io/dynamic-resource-allocation
    structured)."""
    healthy = [d for d in devices if d["attributes"].get("healthy", {}).get("bool", True) and not d.get("taints")]
    expression, selects, cel_error = select or ("", lambda device: True, GopherplugError)
    if select is not None:
        say("scheduler", f"selector #0 of claim {claim}: {expression}")
    chosen, failed = None, ""
    for device in sorted(devices, key=lambda d: _natural_key(d["name"])) if select is None else devices:
        try:
            verdict = "selected" if selects(device) else "not selected"
        except cel_error as error:  # a CEL runtime error: the scheduler's Filter aborts the attempt
            verdict = f"claim {claim}: selector #0: CEL runtime error: {error}"
            failed = failed or ("" if chosen else verdict)
        chosen = chosen or (device if verdict == "selected" and device in healthy and not failed else None)
        if select is not None:
            say("scheduler", f"  {device['name']}{'' if device in healthy else ' (unhealthy)'}: {verdict}")
    if failed:
        say("scheduler", f"the claim stays unallocated, its pod Pending (FailedScheduling): {failed}")
    elif chosen is None:
        say(
            "scheduler",
            f"no healthy device in pool {pool}{' is selected' if select else ''}: a claim stays unallocated",
        )
    return chosen


def _demo_cdi_edits(spec_dir: str, kind: str, name: str) -> dict[str, Any]:
    """The containerEdits of CDI device ``kind``=``name`` in the spec files of ``spec_dir``, as the
    runtime finds them (the resource's spec, a claim's own for a share or the device metadata)."""
    for entry in sorted(os.listdir(spec_dir)):
        if entry.endswith(".json"):
            with open(os.path.join(spec_dir, entry), encoding="utf-8") as file:
                spec = json.load(file)
            if spec.get("kind") == kind:
                for device in spec.get("devices", ()):
                    if device["name"] == name:
                        return dict(device.get("containerEdits", {}))
    return {}


########################################################################################################
# 9. Command line
#
# Rules for this section: parse, validate everything, then run; return an exit code: 0 on a
# requested shutdown, 2 on bad usage or configuration, 1 on a runtime failure. Signals are handled
# here and only here.
########################################################################################################

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
LOG_LEVELS, LOG_FORMATS = ["debug", "info", "warning", "error"], ["text", "json"]


def _parser() -> argparse.ArgumentParser:
    env = os.environ.get
    # allow_abbrev=False everywhere: argparse would otherwise take any unambiguous prefix of an
    # option for the option, and generic-device-plugin's --device would be read as
    # --device-plugin-dir (a JSON document "must be an absolute path"). An option is spelt out.
    parser = argparse.ArgumentParser(
        prog="gopherplug",
        description="A Kubernetes device plugin: the entries of a directory become schedulable devices.",
        epilog="Without a command, runs `serve`.",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"gopherplug {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="{serve,check-config,probe,who,demo,kubelet}")
    subcommand = functools.partial(commands.add_parser, allow_abbrev=False)
    serve = subcommand("serve", help="run the device plugin (the default)")
    check = subcommand(
        "check-config",
        help="validate a configuration file, and the options and environment serve would read, and show what each "
        "resource finds and gives a container (exit 2 if invalid)",
    )
    check.add_argument(
        "--strict",
        action="store_true",
        help="exit 1 when a resource has a warning or no healthy device (default: exit 0 if the file is valid, "
        "as serve would run)",
    )
    what = "ask the running plugin for its options and devices, as the kubelet would (exit 1 if any fails)"
    probe_ = subcommand("probe", help=what)
    probe_.add_argument(
        "--resource", action="append", metavar="NAME", help="probe this resource only (repeatable; default: all)"
    )
    probe_.add_argument(
        "--grace",
        type=float,
        default=PROBE_STREAM_GRACE,
        metavar="SECONDS",
        help=f"fail a resource whose ListAndWatch the kubelet has not read for longer (default {PROBE_STREAM_GRACE:g})",
    )
    who = subcommand(
        "who", help="each configured device with its health, its path and the pod and container holding it"
    )
    who.add_argument("--json", action="store_true", help="one JSON document, for scripts")
    who.add_argument(
        "--pod-resources-socket",
        default=None,  # the env var is read in _who, so that a message about it can name it
        metavar="PATH",
        help="the kubelet's PodResources socket (env GOPHERPLUG_POD_RESOURCES_SOCKET; default: "
        "pod-resources/kubelet.sock in the kubelet's root directory)",
    )
    demo = subcommand("demo", help="run the plugin against a simulated kubelet in a temporary directory, step by step")
    demo.add_argument(
        "--dra",
        action="store_true",
        help="the DRA flow instead: slices, claims, CDI, against a simulated kubelet and API server "
        "(needs the dra extra); with --config, every resource served through DRA",
    )
    demo.add_argument(
        "--config",
        default=None,  # not GOPHERPLUG_CONFIG: the built-in demo unless a file is named here
        metavar="FILE",
        help="your configuration instead of the demo's: its devices scanned where it says, registered, listed, and "
        "one Allocate (or one DRA claim prepared) per resource",
    )
    demo.add_argument(
        "--select",
        action="append",
        metavar="[RESOURCE=]CEL",
        help="with --config and --dra, once per resource: a claim's device selector for RESOURCE (bare: the file's "
        "one), evaluated on each device as the scheduler would (the Kubernetes CEL library's quantity and semver "
        "functions included; needs the cel extra)",
    )
    kubelet = subcommand(
        "kubelet",
        help="be a kubelet's device manager on a directory, in the foreground, saying what it sees of the plugins "
        f"that register there; on standard input: {KUBELET_REQUESTS}; SIGUSR1: allocate",
    )
    kubelet.add_argument(
        "--device-plugin-dir",
        required=True,  # never a real kubelet's by default: the simulator deletes the sockets it finds there
        metavar="DIR",
        help="the directory to serve kubelet.sock in (made if missing); give the plugin the same one",
    )
    for command in (serve, check, probe_, who):
        command.add_argument(
            "--config",
            default=env("GOPHERPLUG_CONFIG"),
            metavar="FILE",
            help="configuration file (env GOPHERPLUG_CONFIG)",
        )
        command.add_argument(
            "--device-plugin-dir",
            default=None,  # the env var is read in main, so that a message about it can name it
            metavar="DIR",
            help="the kubelet's device-plugin directory, overriding the file's (env GOPHERPLUG_DEVICE_PLUGIN_DIR)",
        )
    for command, does in (
        (serve, "serve Prometheus metrics there"),
        (check, "the metrics address serve would use, checked"),
    ):
        command.add_argument(
            "--metrics-address",
            default=None,  # the env var is read in main, so that a message about it can name it
            metavar="HOST:PORT",
            help=f"{does}, overriding the file's metrics_address (env GOPHERPLUG_METRICS_ADDRESS; serving needs the "
            "metrics extra)",
        )
    for command, default in ((serve, "info"), (demo, "warning"), (kubelet, "warning")):
        command.add_argument(
            "--log-level",
            default=env("GOPHERPLUG_LOG_LEVEL", default),
            type=str.lower,
            choices=LOG_LEVELS,
            help=f"log level (env GOPHERPLUG_LOG_LEVEL, default {default})",
        )
        command.add_argument(
            "--log-format",
            default=env("GOPHERPLUG_LOG_FORMAT", "text"),
            type=str.lower,
            choices=LOG_FORMATS,
            help="one line per event, as text or as a JSON object (env GOPHERPLUG_LOG_FORMAT, default text)",
        )
    # check-config logs nothing, but the log settings serve would take from the environment are
    # checked (in main) as serve's are: lower-cased, as the options' type makes them.
    level, log_format = env("GOPHERPLUG_LOG_LEVEL"), env("GOPHERPLUG_LOG_FORMAT")
    check.set_defaults(log_level=level and level.lower(), log_format=log_format and log_format.lower())
    return parser


_GENERIC_DEVICE_FLAG = (
    "is generic-device-plugin's option, not gopherplug's: write each --device as a resource of the "
    "configuration file given by --config (docs/generic-device-plugin.md translates it)"
)


def main(argv: list[str] | None = None) -> int:
    """The ``gopherplug`` command (_main), quiet when its reader goes away: ``check-config | head -1``
    closes the pipe after one line, and what was read is all that was wanted. Not SIGPIPE's default
    action, which would end serve too at a peer's closed socket."""
    try:
        with _held_back("command", "", GopherplugError, logger=None):  # a bug: one line, never a traceback
            try:
                return _main(argv)
            except BrokenPipeError:
                # As Python's signal documentation advises: stdout pointed at /dev/null, so that the
                # flush at exit fails no more; the exit status a shell reports for a command SIGPIPE ended.
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                return 128 + signal.SIGPIPE
    except GopherplugError as error:
        print(f"gopherplug: {error}", file=sys.stderr)
        if error.__cause__ is not None and os.environ.get("GOPHERPLUG_LOG_LEVEL", "").lower() == "debug":
            import traceback  # here, where a bug is

            traceback.print_exception(error.__cause__)
        return EXIT_FAILURE


def _main(argv: list[str] | None = None) -> int:
    """The ``gopherplug`` command. Returns the process exit code, but for ``serve`` stopped as asked
    (SIGTERM, SIGINT), which ends the process itself once everything is closed, without the
    interpreter's teardown (atexit handlers do not run)."""
    global _OWNS_PROCESS
    if argv is None:  # the command itself (console script, python -m gopherplug, gopherplug.py)
        _OWNS_PROCESS = True
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = ("serve", "check-config", "probe", "who", "demo", "kubelet")
    if argv and argv[0] not in commands and not argv[0].startswith("-"):  # a word, not a command: a typo
        import difflib  # here, where a mistake is

        close = difflib.get_close_matches(argv[0], commands, n=1)
        meant = f"did you mean {close[0]}?" if close else f"the commands are {', '.join(commands)}"
        print(f"gopherplug: {argv[0]!r} is not a command: {meant}", file=sys.stderr)
        return EXIT_USAGE
    if not argv or argv[0] not in {*commands, "-h", "--help", "--version"}:
        argv.insert(0, "serve")  # serve is the default command
    # generic-device-plugin's own option, carried over from its DaemonSet: not an abbreviation
    # (there are none, see _parser), and not unrecognized without a word on where its meaning went.
    for arg in argv[: argv.index("--") if "--" in argv else len(argv)]:
        if arg == "--device" or arg.startswith("--device="):
            print(f"gopherplug: --device: {_GENERIC_DEVICE_FLAG}", file=sys.stderr)
            return EXIT_USAGE
    parser = _parser()
    try:
        args, unknown = parser.parse_known_args(argv)
    except SystemExit as exit_:  # argparse has printed the usage error (or the help)
        return exit_.code if isinstance(exit_.code, int) else EXIT_USAGE
    if unknown:  # argparse would say "unrecognized arguments", and not what was meant
        return _unknown_argument(parser, args.command, unknown[0], argv)
    # argparse checks an option's choices only when it is given, not the default it took from the
    # environment: a value that passed unchecked came from the variable, which the message names.
    for option, choices, variable in (
        ("log_level", LOG_LEVELS, "GOPHERPLUG_LOG_LEVEL"),
        ("log_format", LOG_FORMATS, "GOPHERPLUG_LOG_FORMAT"),
    ):
        if (value := getattr(args, option, None)) is not None and value not in choices:
            print(f"gopherplug: {variable}: {value!r}: use one of {', '.join(choices)}", file=sys.stderr)
            return EXIT_USAGE
    if getattr(args, "device_plugin_dir", "") is None and os.environ.get("GOPHERPLUG_DEVICE_PLUGIN_DIR"):
        args.device_plugin_dir = os.environ["GOPHERPLUG_DEVICE_PLUGIN_DIR"]
        args.device_plugin_dir_from = "GOPHERPLUG_DEVICE_PLUGIN_DIR"
    if args.command == "demo":
        if args.select is not None and (args.config is None or not args.dra):
            print("gopherplug: --select: give --config FILE and --dra: it selects among your devices", file=sys.stderr)
            return EXIT_USAGE
        if args.config is None:
            return _run(args, run_dra_demo if args.dra else run_demo)
        try:  # refused as check-config refuses it
            config = load_demo_config(args.config, args.dra)
            select = demo_selectors(args.select or (), config)
        except GopherplugError as error:  # the file, or the selector (the API server would refuse it too)
            print(f"gopherplug: {'' if isinstance(error, ConfigError) else '--select: '}{error}", file=sys.stderr)
            return EXIT_USAGE
        for warning in config.warnings:
            print(f"gopherplug: warning: {warning}", file=sys.stderr)
        return _run(args, functools.partial(run_config_demo, select=select), config)
    if args.command == "kubelet":
        return _kubelet(args)
    if args.command == "probe":
        return _probe(args)
    if not args.config:
        print("gopherplug: no configuration: give --config FILE or set GOPHERPLUG_CONFIG", file=sys.stderr)
        return EXIT_USAGE
    try:
        objects = args.command == "check-config"  # the chart's ConfigMap, or helm template's output, too
        config = load_config(args.config, args.device_plugin_dir, _device_plugin_dir_from(args), objects=objects)
    except ConfigError as error:
        print(f"gopherplug: {error}", file=sys.stderr)
        return EXIT_USAGE
    if args.command == "who":
        return _who(args, config)
    # check-config checks what serve would read, so that it refuses what serve refuses.
    given_as = "--metrics-address"
    if args.metrics_address is None and os.environ.get("GOPHERPLUG_METRICS_ADDRESS"):
        args.metrics_address, given_as = os.environ["GOPHERPLUG_METRICS_ADDRESS"], "GOPHERPLUG_METRICS_ADDRESS"
    if args.metrics_address is not None:
        if (problem := metrics_address_problem(args.metrics_address)) is not None:
            print(f"gopherplug: {given_as}: {problem}", file=sys.stderr)
            return EXIT_USAGE
        config = dataclasses.replace(config, metrics_address=args.metrics_address)
    if args.command == "check-config":
        return _check_config(args, config)
    given = (args.device_plugin_dir, _device_plugin_dir_from(args), args.metrics_address)
    raise_open_files_limit()
    code = _run(args, _serve_until_signalled, config, args.config, *given)
    if code == EXIT_OK:
        # Stopped as asked: every socket, watch and connection is closed, and the log says so. The
        # interpreter's teardown would now collect every object of every module (lightkube's models
        # are thousands of classes): 30 to 150 ms of CPU here, longer where the pod's share of the
        # CPU is small (the DaemonSets request 10m), and every pod of a rollout waits for it. Nothing
        # in it matters to a process about to end, so it ends here, its output flushed.
        _exit_now(code)
    return code


def _check_config(args: argparse.Namespace, config: Config) -> int:
    """``gopherplug check-config``: the config as serve takes it, what this machine would offer now."""
    strict: list[str] = []  # what --strict fails for, said as it is found

    def warn(line: str, failing: str = "") -> None:
        if line:
            print(f"gopherplug: warning: {line}", file=sys.stderr)
        if failing and args.strict:
            print(f"gopherplug: --strict: {failing}", file=sys.stderr)
            strict.append(failing)

    for warning in config.warnings:  # valid, but likely not what was meant; serve logs them
        warn(warning)
    names = ", ".join(f"{r.name} ({r.origin()})" for r in config.resources)
    where = []
    mistaken = None
    if any(resource.device_plugin for resource in config.resources):
        found = f"the first of {', '.join(KNOWN_DEVICE_PLUGIN_DIRS)} to hold kubelet.sock at start"
        where.append(f"kubelet at {config.device_plugin_dir or found}")
        if config.device_plugin_dir is not None:
            mistaken = device_plugin_dir_mistake(config.device_plugin_dir)
    if config.dra is not None:
        where.append(f"DRA driver {config.dra.driver}, kubelet root {config.dra.kubelet_dir}")
    print(f"{config.source}: OK: {len(config.resources)} resource(s): {names}; {'; '.join(where)}")
    named = _device_plugin_dir_from(args) if args.device_plugin_dir is not None else "device_plugin_dir"
    if mistaken is not None:  # a typo: serve would wait for the kubelet for ever
        warn(f"{named}: {mistaken}", f"{named}: no kubelet.sock")
    # What the kubelet would be offered if the plugin started now, on this machine. Run by root
    # on the node, this process can open any file (CAP_DAC_OVERRIDE), which the shipped pod
    # cannot: its verdict on the mode and owner is shown beside ours. The pod's device cgroup
    # would refuse to open device nodes, but the plugin takes that refusal for what it is (see
    # _health_problem), so it changes nothing here.
    mountinfo = _read_text("/proc/self/mountinfo") or ""
    dac_override = _has_capability(_CAP_DAC_OVERRIDE)
    node_name = os.environ.get("NODE_NAME") or socket.gethostname()  # DRA pools are named after it
    if config.dra is not None and not os.environ.get("NODE_NAME"):  # serve_plugin stops without it
        warn(
            "NODE_NAME is not set: serve would stop at start, as the DRA driver names this node's pools after "
            f"it (in a DaemonSet from spec.nodeName); shown here with the host name, {node_name}",
            f"DRA driver {config.dra.driver}: NODE_NAME is not set",
        )
    offered: list[tuple[ResourceConfig, tuple[DeviceEntry, ...]]] = []
    for resource in config.resources:
        directories = [s.directory for s in resource.sources] + ([config.dev_root] if resource.usb else [])
        problems = [p for d in directories if (p := container_only_problem(d, mountinfo))]
        problems += missing_source_problems(resource, config.sysfs_root, config.dev_root)
        scan = scan_directory(resource, config.sysfs_root, config.dev_root)
        scan, value_problems = described_scan(resource, scan)
        problems += value_problems
        offered.append((resource, scan.devices))
        print(scan_report(resource, scan, *problems, in_pod=_pod_view(scan) if dac_override else None))
        view, refused = container_report(resource, scan, config.dra.driver if config.dra else "", node_name)
        print(view)
        reasons = ["a warning"] if problems or scan.problem or refused else []
        reasons += [] if any(device.health == HEALTHY for device in scan.devices) else ["no healthy device"]
        if reasons:
            warn("", f"{resource.name}: {' and '.join(reasons)}")
    for problem in _rights_problems(config):
        warn(problem)
    for problem in missing_extras(config):  # serve would stop at start
        warn(f"{problem}: serve would stop at start", problem.split(" (")[0])
    for line in shared_nodes(offered):  # what serve warns about too, once each
        warn(line, f"{line.split(' is offered by ')[0]}: offered twice")
    if config.nfd_features_file is not None:  # the labels NFD would give this node, as serve writes them
        features = nfd_features((resource, {d.id: d for d in devices}) for resource, devices in offered)
        print(f"NFD feature file {config.nfd_features_file} (nfd_features_file), as serve would write it:")
        print("\n".join(f"  {line}" for line in features.splitlines() if not line.startswith("#")))
    return EXIT_FAILURE if strict else EXIT_OK


def _unknown_argument(parser: argparse.ArgumentParser, command: str, word: str, argv: list[str]) -> int:
    """One line for the first argument ``command`` does not take: the option nearest to a
    misspelt one (``--conf``), or for a file named without ``--config`` how to give it."""
    import difflib  # here, where a mistake is

    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    options = [option for action in sub._actions for option in action.option_strings if option.startswith("--")]
    if not word.startswith("-"):
        given = any(arg.partition("=")[0] == "--config" for arg in argv)
        meant = f"use --config {word}" if "--config" in options and not given else "it takes no word"
        print(f"gopherplug {command}: {word!r}: {meant}", file=sys.stderr)
        return EXIT_USAGE
    close = difflib.get_close_matches(word.partition("=")[0].lstrip("-"), [o[2:] for o in options], n=1)
    meant = f"did you mean --{close[0]}?" if close else f"gopherplug {command} --help lists them"
    print(f"gopherplug {command}: {word.partition('=')[0]} is not an option: {meant}", file=sys.stderr)
    return EXIT_USAGE


def raise_open_files_limit() -> tuple[int, int]:
    """Raise this process's soft limit of open files to its hard limit, as every Go program does at
    start (the Go runtime since 1.19, os/rlimit.go; the kubelet and grpc-go plugins among them), and
    return (soft, hard) as they are now. Each connection takes a file: a container runtime's default
    soft limit (1,024, 128 in some) is what a peer holding connections open would exhaust first, and
    the kubelet's probe would then wait for a free one. The hard limit is the runtime's own choice
    (LimitNOFILE, the pod's), which the process may raise its soft limit to without privilege.
    select() cannot watch a file numbered 1,024 or more; nothing here uses it (trio uses epoll)."""
    import resource as rlimits  # (`resource` is what the rest of this file calls a configured resource)

    soft, hard = rlimits.getrlimit(rlimits.RLIMIT_NOFILE)
    if soft != hard:
        try:
            rlimits.setrlimit(rlimits.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (OSError, ValueError) as error:  # a seccomp profile, a hard limit of "unlimited" refused
            log.debug("cannot raise the open-files limit from %d to %d: %s", soft, hard, _describe(error))
    return soft, hard


def _device_plugin_dir_from(args: argparse.Namespace) -> str:
    """Where the device-plugin directory was given: the option or the environment variable."""
    return getattr(args, "device_plugin_dir_from", "--device-plugin-dir")


_CAP_DAC_OVERRIDE = 1  # linux/capability.h: bypass file read, write and execute permission checks


def _who(args: argparse.Namespace, config: Config) -> int:
    """`gopherplug who`: this configuration's devices, scanned now, and their holders, from the kubelet."""
    socket_path, given_as = args.pod_resources_socket, "--pod-resources-socket"
    if socket_path is None and os.environ.get("GOPHERPLUG_POD_RESOURCES_SOCKET"):
        socket_path, given_as = os.environ["GOPHERPLUG_POD_RESOURCES_SOCKET"], "GOPHERPLUG_POD_RESOURCES_SOCKET"
    if socket_path is not None and not os.path.exists(socket_path):
        # Given, and wrong: list_pod_resources' advice (mount it, or give the option) is for the default path.
        print(
            f"gopherplug: {given_as}: {socket_path} does not exist: give the kubelet's PodResources socket, "
            f"{POD_RESOURCES_SOCKET} in its root directory ({os.path.join(DEFAULT_KUBELET_DIR, POD_RESOURCES_SOCKET)} "
            "by default)",
            file=sys.stderr,
        )
        return EXIT_FAILURE
    socket_path = socket_path or pod_resources_socket(config)
    node_name = os.environ.get("NODE_NAME") or socket.gethostname()  # DRA pools are named after it
    devices = [(r, scan_directory(r, config.sysfs_root, config.dev_root).devices) for r in config.resources]
    try:
        pods = trio.run(list_pod_resources, socket_path, lambda line: print(f"gopherplug: {line}", file=sys.stderr))
    except GopherplugError as error:
        print(f"gopherplug: {error}", file=sys.stderr)
        return EXIT_FAILURE
    held = device_holders(devices, pods, config.dra.driver if config.dra else "", node_name)
    print(json.dumps([dataclasses.asdict(device) for device in held]) if args.json else who_report(held))
    return EXIT_OK


def _kubelet(args: argparse.Namespace) -> int:
    """``gopherplug kubelet``: the kubelet simulator until SIGINT or SIGTERM, narrated on standard
    output; each line of standard input is a request (kubelet_request), and so is SIGUSR1 (allocate
    one device of each resource). Refused where a kubelet answers on kubelet.sock already: starting,
    the simulator deletes every socket of the directory, that kubelet's and its plugins' too."""
    path = os.path.join(args.device_plugin_dir, KUBELET_SOCKET)
    with socket.socket(socket.AF_UNIX) as probe, contextlib.suppress(OSError):
        probe.connect(path)
        print(f"gopherplug: kubelet: {path} answers: a kubelet serves this directory already", file=sys.stderr)
        return EXIT_USAGE

    async def main() -> None:
        say = _demo_clock(functools.partial(print, flush=True))
        async with trio.open_nursery() as nursery:
            kubelet = await nursery.start(KubeletSimulator(args.device_plugin_dir).run)
            say("kubelet", f"serving Registration on {path}; requests: {KUBELET_REQUESTS}")
            nursery.start_soon(KubeletNarrator(kubelet, say).follow)
            nursery.start_soon(read_requests, kubelet, say)
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGUSR1) as signals:
                async for signum in signals:
                    if signum != signal.SIGUSR1:
                        break
                    await kubelet_request(kubelet, "allocate", say)
            nursery.cancel_scope.cancel()
        say("kubelet", "stopped: kubelet.sock removed")

    async def read_requests(kubelet: KubeletSimulator, say: Callable[[str, str], None]) -> None:
        # A thread, not a non-blocking descriptor: stdin may be the terminal the shell shares.
        while line := await trio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True):
            await kubelet_request(kubelet, line, say)  # at the end of the input, only signals ask

    return _run(args, main)


def _has_capability(number: int) -> bool:
    """Whether this process has capability ``number`` in effect (CapEff in /proc/self/status)."""
    for line in (_read_text("/proc/self/status") or "").splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> number & 1)
    return False


def _rights_problems(config: Config) -> list[str]:
    """For check-config without root's rights, where serve would fail at start: a line for each
    place serve writes in (a missing directory: its parent, where serve makes it) or socket it
    connects to (the kubelet's) that this process cannot."""
    wanted = [(resource.cdi.spec_dir, "write CDI specs in") for resource in config.resources if resource.cdi]
    if any(resource.device_plugin for resource in config.resources):
        found = [d for d in KNOWN_DEVICE_PLUGIN_DIRS if os.path.exists(os.path.join(d, KUBELET_SOCKET))]
        plugin_dir = config.device_plugin_dir or (found or KNOWN_DEVICE_PLUGIN_DIRS)[0]
        wanted += [(plugin_dir, "create its sockets in"), (os.path.join(plugin_dir, KUBELET_SOCKET), "connect to")]
    if config.dra is not None:
        wanted += [(os.path.dirname(config.dra.registration_socket), "create its registration socket in")]
        wanted += [(config.dra.plugin_dir, "create its DRA socket and checkpoint in")]
    if config.nfd_features_file is not None:
        wanted.append((os.path.dirname(config.nfd_features_file), "write the NFD feature file in"))
    cannot = f"which this process (uid {os.geteuid()}) cannot: run it as root"
    lines = []
    for path, does in dict.fromkeys(wanted):
        there = path
        while does != "connect to" and not os.path.exists(there):
            there = os.path.dirname(there)
        if os.path.exists(there) and not os.access(there, os.W_OK | (0 if does == "connect to" else os.X_OK)):
            lines.append(f"serve will need to {does} {path}, {cannot}")
    return lines


def _pod_view(scan: Scan) -> dict[str, str]:
    """For check-config: the healthy members the shipped pod would find unhealthy, by their mode."""
    return {
        member.path: why
        for device in scan.devices
        for member in device.members or (device,)
        if member.health == HEALTHY
        and (why := pod_mode_problem(member.path, _access_needed(member.device_specs, member.is_device_node)))
    }


def _probe(args: argparse.Namespace) -> int:
    config = None
    if args.config:  # optional: without it, every gopherplug socket in the directory is probed
        try:
            config = load_config(args.config, args.device_plugin_dir, _device_plugin_dir_from(args))
        except ConfigError as error:
            print(f"gopherplug: {error}", file=sys.stderr)
            return EXIT_USAGE
    failed = False
    if config is not None and config.dra is not None:  # the DRA driver, as the kubelet sees it
        dra = trio.run(probe_dra, config.dra, args.grace)
        print(dra_probe_report(dra))
        failed = bool(dra.error)
    # The resources served through the device-plugin API (all of them, without dra), as the device manager sees them.
    names = args.resource or ([r.name for r in config.resources if r.device_plugin] if config else None)
    if names == []:  # a DRA driver only
        return EXIT_FAILURE if failed else EXIT_OK
    # Not find_device_plugin_dir(): serve waits for a kubelet that is not there yet, and says so;
    # probe has nothing to wait for, and fails with the one line that says why.
    directory = (
        args.device_plugin_dir or (config and config.device_plugin_dir) or _kubelets_directory(KNOWN_DEVICE_PLUGIN_DIRS)
    )
    if not directory:
        print(
            f"gopherplug: no kubelet.sock in {', '.join(KNOWN_DEVICE_PLUGIN_DIRS)}: no kubelet runs here, or it uses "
            "another directory: give --device-plugin-dir (or --config)",
            file=sys.stderr,
        )
        return EXIT_FAILURE
    results = trio.run(probe, directory, names, args.grace)
    print(probe_report(results) if results else f"no gopherplug socket in {directory}")
    return EXIT_OK if results and not failed and not any(result.error for result in results) else EXIT_FAILURE


class _LogFormatter(logging.Formatter):
    """One line per event: "time LEVEL message" (a resource's message begins with its name), or
    the same as one JSON object, the resource's name in its own field."""

    def __init__(self, json_lines: bool) -> None:
        super().__init__()
        self.json_lines = json_lines
        self._zone: datetime.tzinfo | None = None  # the local zone's offset in _zone_second
        self._zone_second = -1

    def format(self, record: logging.LogRecord) -> str:
        resource = getattr(record, "resource", None)
        message = record.getMessage()  # a resource's line begins with its name already (_ResourceLog)
        if self.json_lines:
            event = {"time": self.formatTime(record), "level": record.levelname.lower(), "message": message}
            if resource:
                # The name once, in its own field, where a log pipeline filters on it.
                event["message"] = message.removeprefix(f"{resource}: ")
                event["resource"] = resource
            if record.exc_info:  # only a bug in gopherplug logs a traceback
                event["traceback"] = self.formatException(record.exc_info)
            return json.dumps(event)
        line = f"{self.formatTime(record)} {record.levelname} {message}"
        return f"{line}\n{self.formatException(record.exc_info)}" if record.exc_info else line

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802
        # ISO 8601 with milliseconds and the offset: sortable, and unambiguous across nodes. The
        # local zone's offset is looked up once a second (a zone changes its offset on a second).
        second = int(record.created)
        if second != self._zone_second:
            self._zone = datetime.datetime.fromtimestamp(record.created).astimezone().tzinfo
            self._zone_second = second
        return datetime.datetime.fromtimestamp(record.created, self._zone).isoformat(timespec="milliseconds")


def _configure_logging(level: str, log_format: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_LogFormatter(json_lines=log_format == "json"))
    # Debug is for gopherplug's own lines: at DEBUG, h2 and hpack log every frame and header-table
    # change (36 lines per Allocate, ~100 for a registration) and drown them. Other libraries: INFO at most.
    logging.basicConfig(level=max(logging.getLevelName(level.upper()), logging.INFO), handlers=[handler], force=True)
    log.setLevel(level.upper())
    # What _LogFormatter never prints, no record needs to gather (the logging HOWTO's "Optimization"
    # section names these switches): the calling function's file and line, found by walking the
    # stack, and the thread's and process's names and ids. Each Allocate logs a line, and this is
    # most of its cost. Only here, where gopherplug is the program and owns its logging: an
    # embedding program's records keep all of it.
    logging._srcfile = None
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False


def _run(log_args: argparse.Namespace, main_task: Callable[..., Awaitable[None]], *args: Any) -> int:
    """Run ``main_task(*args)`` under trio; a GopherplugError becomes one logged line and exit 1."""
    _configure_logging(log_args.log_level, log_args.log_format)
    try:
        trio.run(main_task, *args)
    except Exception as error:
        if not isinstance(_innermost(error), GopherplugError):
            raise
        log.error("%s", _innermost(error))
        return EXIT_FAILURE
    return EXIT_OK


#: How long the command line waits, from SIGTERM, for the plugin to stop. Every part of it is
#: stopped in turn within STOP_PART_TIMEOUT, in milliseconds when all goes well; a part still running
#: after that (a thread the kernel holds) would keep the process alive until it ends, maybe for
#: good, and the kubelet would kill it only after the pod's terminationGracePeriodSeconds (30 s by
#: default). Every rollout of the DaemonSet pays the stop once per node: three parts' bounds, then
#: the process exits without what is still running (its sockets are gone already: serve_grpc).
STOP_TIMEOUT = 3 * STOP_PART_TIMEOUT


async def serve_until_signalled(
    async_fn: Callable[..., Awaitable[object]], *args: Any, on_sighup: Callable[[], object] | None = None
) -> None:
    """Run ``async_fn(*args)`` until SIGTERM or SIGINT, then stop it as the command line stops:
    the entry point for a program of your own (``trio.run(serve_until_signalled, main)``).

    A signal cancels ``async_fn``: serve_plugin() and serve_devices() then stop their parts one at
    a time, each ``finally`` removing what it made (sockets, lock files), and this returns once
    they have. A stop not done after STOP_TIMEOUT (a part stuck where no cancellation reaches, a
    thread the kernel holds) ends the process at once with exit code 0, its log flushed, as the
    kubelet's SIGKILL would 30 s later: the sockets are gone by then (serve_grpc removes its own
    first). If ``async_fn`` returns or raises first, so does this.

    SIGTERM is how the kubelet deletes a pod, SIGINT is Ctrl-C: without this, either kills the
    process and leaves its sockets and lock files behind. SIGHUP is taken only with ``on_sighup``
    (called at each: the command line reads its configuration again); SIGCHLD only as PID 1 of a
    container (_reap_orphans). Signals are received from before ``async_fn`` starts, and (trio's
    rule) only in the main thread."""
    asked = (signal.SIGTERM, signal.SIGINT) + ((signal.SIGHUP,) if on_sighup is not None else ())
    asked += (signal.SIGCHLD,) if os.getpid() == 1 else ()  # _reap_orphans
    serving, stopped = trio.CancelScope(), trio.Event()
    began: float | None = None
    with trio.open_signal_receiver(*asked) as signals:
        async with trio.open_nursery() as nursery:

            async def serve() -> None:
                with serving:
                    await async_fn(*args)
                stopped.set()
                nursery.cancel_scope.cancel()  # stopped as asked, or done on its own: no signal to wait for

            nursery.start_soon(serve)
            async for signum in signals:
                if signum in (signal.SIGHUP, signal.SIGCHLD):
                    on_sighup() if signum == signal.SIGHUP and on_sighup is not None else _reap_orphans()
                    continue
                log.info("%s received: stopping", signal.Signals(signum).name)
                break
            began = trio.current_time()
            serving.cancel()
            with trio.move_on_after(STOP_TIMEOUT):
                await stopped.wait()
            if not stopped.is_set():
                # trio cannot leave a task behind, and the one left is stuck where no cancellation
                # reaches (the warnings above name it): end the process as SIGKILL would, only sooner.
                log.warning("stop: not done after %g s: exiting without waiting for the rest", STOP_TIMEOUT)
                _exit_now(EXIT_OK)
    if began is not None:
        log.debug("stop: done in %.0f ms", 1000 * (trio.current_time() - began))


async def _serve_until_signalled(
    config: Config,
    path: str,
    device_plugin_dir: str | None,
    device_plugin_dir_from: str,
    metrics_address: str | None = None,
) -> None:
    """`gopherplug serve`: serve_plugin() with the file's edits applied as they are saved, until
    SIGTERM or SIGINT, stopped by serve_until_signalled() as an embedding program's plugin is."""
    _release_freed_memory()  # what compiling the module and reading the configuration left behind
    watches: list[DirectoryWatch] = []
    for warning in config.warnings:  # valid, but likely not what was meant (a reload logs its own)
        log.warning("%s", warning)

    def read_again() -> None:
        # SIGHUP asks daemons by convention to read their configuration again: the file is read as
        # if inotify had seen it change (it may not have: a write through a hard link elsewhere, a
        # filesystem without inotify such as NFS).
        log.info("SIGHUP received: reading %s again", path)
        for watch in watches[-1:]:  # the one running now
            watch.poke()

    def updates(current: Config) -> AsyncGenerator[Config, None]:  # a watch that failed is started anew
        return watch_config_file(
            path, device_plugin_dir, current, device_plugin_dir_from, watches.append, metrics_address
        )

    await serve_until_signalled(functools.partial(serve_plugin, config, updates=updates), on_sighup=read_again)


def _exit_now(code: int) -> NoReturn:
    """End the process with ``code`` at once, its log and output flushed: no atexit handler, no
    interpreter teardown."""
    logging.shutdown()
    with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing more can reach it anyway
        sys.stdout.flush()
    os._exit(code)


########################################################################################################
# 10. Start-up plumbing
#
# Not the protocol. How `python gopherplug.py` keeps no syntax tree for life: called from the top
# of the file, before any other import, with the code the interpreter compiled for the script.
########################################################################################################


def _run_as_module(script: str) -> None:
    """Start again as an import of this same file, in this same process: what `python gopherplug.py` runs.

    CPython runs a script inside the syntax tree it parsed the file into, and frees that tree
    only when the script returns (pyrun_file in CPython's Python/pythonrun.c frees its arena
    after the module's code has run): for a plugin that serves until it is stopped, never. For
    this file that is about 18 MiB, kept for the life of every `python gopherplug.py serve` (a
    copy run as a sidecar binary), and growing with every line. An import compiles the file and
    frees the tree at once. So the script replaces itself (os.execv: the same PID, arguments,
    environment and interpreter options) with a Python that imports this file and runs main().
    The console script and `python -m gopherplug` import the module already, and a debugger or
    profiler (a trace or profile function set) keeps the script as it is.

    It is called from the top of the file, before any other import: the script's process would
    throw away whatever it imported (the dependencies alone take 150 ms). And it hands the import
    the code it has already compiled (the script was compiled whole before its first line ran,
    about 350 ms for this file): marshalled into a memory file the new process inherits, used in
    place of compiling the file again where no valid bytecode is cached beside it (a read-only
    copy, PYTHONDONTWRITEBYTECODE), and written to that cache where one may be written, as the
    import would have. Only if the file is as it was: a file changed in the last 2 s (maybe since
    the interpreter read it), or whose size or time differs when the import reads it, is compiled
    again from what is on disk.

    What runs is this file, whatever its name (a copy saved as `anyname.py`, a symlink to it),
    loaded by its path, never `import gopherplug` by name: that would find an older gopherplug
    installed in site-packages and run it instead, or fail where none is. The loader is named,
    not guessed from the suffix, so a copy without `.py` runs too. The module is registered as
    sys.modules["gopherplug"] before its code runs, so that an `import gopherplug` anywhere in the
    process (the stand-ins, the demo) gets this copy; its bytecode is cached beside the file, as an
    import's is (`__pycache__/anyname.cpython-311.pyc`). And sys.path is the script's own: `-P`
    keeps `-c` from putting the current directory first (where a `yaml.py` would be imported in
    place of PyYAML, by a process that often runs as root), and the directory Python gave the
    script (its sys.path[0]: the resolved file's, for a symlink) goes back in front, unless the
    script had none either (-P, -I, PYTHONSAFEPATH)."""
    if sys.gettrace() is not None or sys.getprofile() is not None:
        return
    import marshal
    import time

    options = sys.orig_argv[1 : len(sys.orig_argv) - len(sys.argv)]  # -X, -W, -O, ... as given
    script_directory = [] if sys.flags.safe_path else sys.path[:1]
    path = os.path.realpath(script)
    handed = "None"
    try:
        status = os.stat(path)
        if time.time_ns() - status.st_mtime_ns > 2_000_000_000:
            compiled = os.memfd_create("gopherplug-code", 0)  # inherited across execv
            os.write(compiled, marshal.dumps(sys._getframe(1).f_code))  # the module's: our caller's
            os.lseek(compiled, 0, os.SEEK_SET)
            handed = repr((compiled, status.st_size, status.st_mtime_ns))
    except (OSError, ValueError):  # no memfd (an old kernel, a seccomp profile): compiled again
        pass
    code = (
        "import importlib.machinery, importlib.util, os, sys\n"
        f"sys.path[:0] = {script_directory!r}; sys.argv[0] = {script!r}; handed = {handed}\n"
        "class Loader(importlib.machinery.SourceFileLoader):\n"
        "    def source_to_code(self, data, path, *, _optimize=-1):  # the script's code, if the file is as it was\n"
        "        if handed and (len(data), os.stat(path).st_mtime_ns) == handed[1:]:\n"
        "            import _imp, marshal\n"
        "            code = marshal.loads(os.pread(handed[0], os.fstat(handed[0]).st_size, 0))\n"
        "            _imp._fix_co_filename(code, path)  # as for a .pyc: the file's path, not the name typed\n"
        "            return code\n"
        "        return super().source_to_code(data, path, _optimize=_optimize)\n"
        f"loader = Loader('gopherplug', {path!r})\n"
        "gopherplug = importlib.util.module_from_spec(importlib.util.spec_from_loader('gopherplug', loader))\n"
        "sys.modules['gopherplug'] = gopherplug\n"
        "try:\n"
        "    loader.exec_module(gopherplug)\n"
        "except ModuleNotFoundError as error:  # run from a checkout without its dependencies: one line\n"
        "    if error.name in {'gopherplug'} or not error.name: raise\n"
        "    sys.exit(f'gopherplug: {error}: install its dependencies (pip install . in a checkout, or pip '\n"
        "             'install --require-hashes -r requirements/device-plugin.lock), or run it where they are')\n"
        "if handed: os.close(handed[0])\n"
        "sys.exit(gopherplug.main())"
    )
    os.execv(sys.executable, [sys.executable, *options, "-P", "-c", code, *sys.argv[1:]])


if __name__ == "__main__":
    # Run as a script, this file is both __main__ and (for anything importing it) gopherplug:
    # register it under its own name so that there is one module object, not two. (A plain
    # `python gopherplug.py` has started again as an import at the top of the file already.)
    sys.modules.setdefault("gopherplug", sys.modules[__name__])
    sys.exit(main())
