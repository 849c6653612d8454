"""gopherplug: a Kubernetes device plugin in one module, and a lesson in the protocol.

The kubelet learns about hardware from device plugins. A plugin serves the DevicePlugin gRPC API
(v1beta1) on a unix socket in the kubelet's device-plugin directory, registers through the kubelet's
own socket there, streams its device list, and tells the kubelet what a container needs for the
devices it was given. This file does all of that with trio, purerpc, protobuf and inotify.

Read it top to bottom; every section only uses the ones above it:

  1. The kubelet contract      constants, the v1beta1 messages built in code, the service table
  2. Errors                    one base class; config errors name the file and the key
  3. Model                     frozen dataclasses: Config, ResourceConfig, DeviceEntry
  4. Pure core                 YAML -> Config; directory -> devices; devices + request -> responses
  5. purerpc on unix sockets   the fenced glue that makes purerpc serve and call like grpc-go
  6. I/O edges                 inotify watches, the DevicePlugin service, Register with retries
  7. Orchestration             serve_plugin: the nursery tree, kubelet restarts
  8. A kubelet simulator       the kubelet's device manager in miniature, for tests and demos
  9. Command line              main(argv) -> exit code; signals

Quick start:

    pip install .
    gopherplug check-config --config config.example.yaml
    gopherplug serve --config config.example.yaml
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import fnmatch
import itertools
import logging
import math
import os
import re
import shutil
import signal
import stat
import sys
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import h2.events
import purerpc
import trio
import yaml
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, text_format
from google.protobuf.message import DecodeError
from inotify_simple import INotify, flags
from purerpc.grpc_proto import GRPCProtoSocket, GRPCProtoStream
from purerpc.grpc_socket import SocketWrapper
from purerpc.grpclib.config import GRPCConfiguration
from purerpc.grpclib.connection import GRPCConnection
from purerpc.grpclib.events import MessageReceived, RequestEnded, RequestReceived, WindowUpdated
from purerpc.grpclib.exceptions import ProtocolError, RpcFailedError
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
    "REGISTER",
    "UNHEALTHY",
    "Config",
    "ConfigError",
    "DeviceEntry",
    "DeviceSpecTemplate",
    "GRPCServer",
    "GopherplugError",
    "KubeletSimulator",
    "Method",
    "RPCError",
    "ResourceConfig",
    "StatusCode",
    "allocate_response",
    "call_unary",
    "load_config",
    "main",
    "open_stream",
    "parse_config",
    "preferred_allocation_response",
    "scan_directory",
    "serve_grpc",
    "serve_plugin",
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


class ConfigError(GopherplugError):
    """The configuration is wrong: says which file, which key, and what to fix, in one line.

    ``str(error)`` reads like ``gopherplug.yaml: resources[0].directory: must be an absolute path``.
    """

    def __init__(self, source: str, key_path: str, problem: str) -> None:
        super().__init__(f"{source}: {key_path}: {problem}" if key_path else f"{source}: {problem}")
        self.source = source
        self.key_path = key_path
        self.problem = problem


########################################################################################################
# 3. Model
#
# Rules for this section: frozen dataclasses, no I/O. A Config is only ever built by parse_config,
# so every instance is valid.
########################################################################################################


@dataclass(frozen=True)
class DeviceSpecTemplate:
    """One ``device_specs`` entry: a DeviceSpec per allocated device, {id} {path} {index} filled in."""

    host_path: str
    container_path: str
    permissions: str = "rw"


@dataclass(frozen=True)
class ResourceConfig:
    """One extended resource: where its devices come from and what a container gets for them."""

    name: str  #: the extended resource name, e.g. "example.com/gopher"
    directory: str  #: absolute; every matching entry is a device
    pattern: str = "*"  #: fnmatch glob on entry names; hidden entries never match
    env: str = ""  #: env var given the allocated IDs, comma-joined ("" only before parse_config fills it)
    device_specs: tuple[DeviceSpecTemplate, ...] | None = None  #: None: device nodes pass through as they are


@dataclass(frozen=True)
class Config:
    """A whole validated configuration file."""

    resources: tuple[ResourceConfig, ...]
    device_plugin_dir: str = DEFAULT_DEVICE_PLUGIN_DIR
    source: str = "<config>"  #: the file it came from, for messages


@dataclass(frozen=True)
class DeviceEntry:
    """One device found in a resource's directory."""

    id: str  #: the entry's name, which is also the ID the kubelet knows it by
    path: str  #: the entry's full path
    is_device_node: bool = False  #: a character or block device node (then passed through by default)


########################################################################################################
# 4. Pure core
#
# Rules for this section: synchronous and deterministic; inputs are arguments (a directory path,
# not a global), results are return values; no logging, no sleeping. Configuration text becomes a
# Config, a directory becomes devices, devices and a request become the kubelet's responses.
########################################################################################################

# The kubelet accepts an extended resource name ("domain/name") only if it is not native to
# Kubernetes and "requests.<name>" is a qualified name (k8s.io/api helper IsExtendedResourceName).
_QUALIFIED_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
# Device IDs: the kubelet wants at most 63 characters; these characters are safe in env values,
# paths, CDI names and log lines alike.
_DEVICE_ID = re.compile(r"[A-Za-z0-9._-]{1,63}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_TEMPLATE_FIELDS = {"id": "gopher0", "path": "/dev/gopher0", "index": 0}


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


def parse_config(text: str, source: str = "<config>") -> Config:
    """Parse and validate configuration YAML; raise ConfigError naming the first problem found."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error)
        raise ConfigError(source, "", f"invalid YAML ({where}{problem})") from None
    top = _mapping(data, source, "", {"device_plugin_dir", "resources"}, required={"resources"})
    device_plugin_dir = DEFAULT_DEVICE_PLUGIN_DIR
    if "device_plugin_dir" in top:
        device_plugin_dir = _absolute_path(top["device_plugin_dir"], source, "device_plugin_dir")
    entries = top["resources"]
    if not isinstance(entries, list) or not entries:
        raise ConfigError(source, "resources", "must be a non-empty list of resources")
    resources: list[ResourceConfig] = []
    for index, entry in enumerate(entries):
        resource = _parse_resource(entry, source, f"resources[{index}]")
        for earlier, other in enumerate(resources):
            if other.name == resource.name:
                raise ConfigError(
                    source, f"resources[{index}].name", f"{resource.name} is already used by resources[{earlier}]"
                )
        resources.append(resource)
    return Config(tuple(resources), device_plugin_dir, source)


def _parse_resource(entry: Any, source: str, where: str) -> ResourceConfig:
    keys = {"name", "directory", "pattern", "env", "device_specs"}
    data = _mapping(entry, source, where, keys, required={"name", "directory"})
    name = _string(data["name"], source, f"{where}.name")
    if (problem := resource_name_problem(name)) is not None:
        raise ConfigError(source, f"{where}.name", f"{name!r}: {problem}")
    directory = _absolute_path(data["directory"], source, f"{where}.directory")
    pattern = _string(data.get("pattern", "*"), source, f"{where}.pattern")
    env = _string(data.get("env", default_env_name(name)), source, f"{where}.env")
    if not _ENV_NAME.fullmatch(env):
        raise ConfigError(source, f"{where}.env", f"{env!r} is not a valid environment variable name")
    device_specs = None
    if "device_specs" in data:
        specs = data["device_specs"]
        if not isinstance(specs, list):
            raise ConfigError(source, f"{where}.device_specs", "must be a list of {host_path, container_path}")
        device_specs = tuple(
            _parse_device_spec(spec, source, f"{where}.device_specs[{i}]") for i, spec in enumerate(specs)
        )
    return ResourceConfig(name, directory, pattern, env, device_specs)


def _parse_device_spec(entry: Any, source: str, where: str) -> DeviceSpecTemplate:
    data = _mapping(
        entry, source, where, {"host_path", "container_path", "permissions"}, {"host_path", "container_path"}
    )
    paths = [_template(data[key], source, f"{where}.{key}") for key in ("host_path", "container_path")]
    permissions = _string(data.get("permissions", "rw"), source, f"{where}.permissions")
    if not permissions or set(permissions) - set("rwm") or len(set(permissions)) != len(permissions):
        raise ConfigError(source, f"{where}.permissions", f"{permissions!r}: use letters from r, w and m, each once")
    return DeviceSpecTemplate(paths[0], paths[1], permissions)


def _mapping(data: Any, source: str, where: str, allowed: set[str], required: set[str]) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ConfigError(source, where, "must be a mapping of keys to values")
    for key in data:
        if key not in allowed:
            raise ConfigError(
                source,
                f"{where}.{key}" if where else str(key),
                f"unknown key; expected one of {', '.join(sorted(allowed))}",
            )
    for key in sorted(required - data.keys()):
        raise ConfigError(source, f"{where}.{key}" if where else key, "is required")
    return data


def _string(value: Any, source: str, where: str) -> str:
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
    try:
        filled = template.format(**_TEMPLATE_FIELDS)
    except (KeyError, IndexError, ValueError) as error:
        problem = f"{template!r}: bad placeholder ({error}); use {{id}}, {{path}} or {{index}}"
        raise ConfigError(source, where, problem) from None
    if not filled.startswith("/"):
        raise ConfigError(source, where, f"{template!r} must be an absolute path")
    return template


def _natural_key(device_id: str) -> list[Any]:
    """Sort "gopher2" before "gopher10": digits compare as numbers."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", device_id) if part]


def scan_directory(directory: str, pattern: str) -> tuple[tuple[DeviceEntry, ...], tuple[str, ...]]:
    """The devices in ``directory``: (devices in natural order, names skipped as unfit for an ID).

    A missing directory (or a file where the directory should be) has no devices: the kubelet then
    gets an empty list, which drops the resource's capacity to zero at once.
    """
    try:
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return (), ()
    devices, skipped = [], []
    for entry in entries:
        if entry.name.startswith(".") or not fnmatch.fnmatchcase(entry.name, pattern):
            continue
        if not _DEVICE_ID.fullmatch(entry.name):
            skipped.append(entry.name)
            continue
        try:
            mode = os.stat(entry.path).st_mode
        except OSError:
            mode = 0  # e.g. a dangling symlink: still a device, never a device node
        devices.append(DeviceEntry(entry.name, entry.path, stat.S_ISCHR(mode) or stat.S_ISBLK(mode)))
    devices.sort(key=lambda device: _natural_key(device.id))
    return tuple(devices), tuple(sorted(skipped))


def list_and_watch_response(devices: Iterable[DeviceEntry]) -> Any:
    """The ListAndWatch message for a device set: every device, healthy."""
    return v1beta1.ListAndWatchResponse(devices=[v1beta1.Device(ID=device.id, health=HEALTHY) for device in devices])


def device_plugin_options(resource: ResourceConfig) -> Any:
    """What gopherplug implements: a preferred allocation, no pre-start hook."""
    return v1beta1.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)


def allocate_response(resource: ResourceConfig, devices: Mapping[str, DeviceEntry], request: Any) -> Any:
    """Answer Allocate: per container request, the env var with the IDs and the DeviceSpecs.

    Raises RPCError(INVALID_ARGUMENT) naming every requested ID that is not a current device: the
    kubelet then fails the pod with UnexpectedAdmissionError instead of starting it without its device.
    """
    if not request.container_requests:
        raise RPCError(StatusCode.INVALID_ARGUMENT, "AllocateRequest has no container requests")
    response = v1beta1.AllocateResponse()
    for container in request.container_requests:
        ids = list(container.devices_ids)
        unknown = sorted({device_id for device_id in ids if device_id not in devices}, key=_natural_key)
        if unknown:
            raise RPCError(StatusCode.INVALID_ARGUMENT, f"unknown {resource.name} device IDs: {', '.join(unknown)}")
        answer = response.container_responses.add()
        answer.envs[resource.env] = ",".join(ids)
        for index, device_id in enumerate(ids):
            answer.devices.extend(_device_specs(resource, devices[device_id], index))
    return response


def _device_specs(resource: ResourceConfig, device: DeviceEntry, index: int) -> list[Any]:
    if resource.device_specs is None:
        if not device.is_device_node:
            return []
        return [v1beta1.DeviceSpec(host_path=device.path, container_path=device.path, permissions="rw")]
    fields = {"id": device.id, "path": device.path, "index": index}
    return [
        v1beta1.DeviceSpec(
            host_path=spec.host_path.format(**fields),
            container_path=spec.container_path.format(**fields),
            permissions=spec.permissions,
        )
        for spec in resource.device_specs
    ]


def preferred_allocation_response(request: Any) -> Any:
    """Answer GetPreferredAllocation: the must-include devices, then the available ones in natural order.

    Deterministic, and never names a device that is not available. When the request cannot be
    met (too few devices), the answer is short, and the kubelet falls back to its own choice.
    """
    response = v1beta1.PreferredAllocationResponse()
    for container in request.container_requests:
        available = set(container.available_deviceIDs)
        chosen = list(dict.fromkeys(i for i in container.must_include_deviceIDs if i in available))
        for device_id in sorted(available - set(chosen), key=_natural_key):
            if len(chosen) >= container.allocation_size:
                break
            chosen.append(device_id)
        response.container_responses.add(deviceIDs=chosen)
    return response


########################################################################################################
# 5. purerpc on unix sockets
#
# purerpc speaks gRPC over h2 on anyio streams, but its Server and channels are TCP-only, and its
# connection handler does not fit a long-lived ListAndWatch (see DESIGN notes below). This fence
# keeps purerpc's message framing, HTTP/2 state machine and stream objects, and replaces the socket
# plumbing and the per-connection dispatch. It relies on these purerpc 0.8.0 internals, pinned in
# pyproject.toml:
#
#   - purerpc.grpc_socket.SocketWrapper: the writer task; its static _set_socket_options(stream)
#   - purerpc.grpc_socket.GRPCSocket attributes _grpc_connection, _socket, _receive_buffer_size,
#     _streams, _allocate_stream(stream_id), _listen() (the client's reader loop) and the
#     _reader_thread() task its __aenter__ starts on the client side
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
    """purerpc's socket wrapper without its TCP options, waking its writer only when there is data.

    purerpc sets TCP_KEEPIDLE and TCP_NODELAY on every socket. On AF_UNIX they fail with EOPNOTSUPP,
    and purerpc's stock handler swallows the error: the client just times out. A unix socket needs
    none of them (no Nagle, no keepalive: the kernel knows when the peer is gone).

    The writer task sends what h2 has queued. Stock purerpc wakes it on every flush(), and flush()
    runs after every read, mostly with nothing to send; each needless wake is one more trip through
    trio's scheduler, per call. Here flush() takes h2's bytes itself and wakes the writer only for them.
    """

    def __init__(self, connection: GRPCConnection, stream: anyio.abc.ByteStream) -> None:
        super().__init__(connection, stream)
        self._outgoing = bytearray()

    @staticmethod
    def _set_socket_options(stream: Any) -> None:
        pass

    async def flush(self) -> None:
        data = self._grpc_connection.data_to_send()
        if data:
            self._outgoing += data
            self._flush_event.set()

    async def _writer_thread(self) -> None:
        while True:
            if self._outgoing:
                data = bytes(self._outgoing)
                self._outgoing.clear()
                await self._stream.send(data)
            elif self._running:
                await self._flush_event.wait()
                self._flush_event = anyio.Event()
            else:
                return


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

    async def _reader_thread(self) -> None:
        # Client side only. Stock purerpc returns quietly at end of file and leaves every open call
        # waiting forever for a response that cannot come. End them: their receivers see EndOfStream.
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


class _ServerConnection(_GRPCSocket):
    """One accepted connection: reads frames, runs each call in its own task and cancel scope.

    Every DevicePlugin and Registration method takes exactly one request message, so a call starts
    once its request is complete (END_STREAM seen): its task then never waits for input, and a
    unary call runs from request to response in one step of trio's scheduler.

    Resource handling: every call gets a trio.CancelScope kept in ``calls`` until its task ends.
    RST_STREAM cancels that one scope (or drops a request still arriving); end of file (the peer
    closed the connection) cancels them all. Reset streams are removed from purerpc's stream
    table, which only forgets streams that ended normally in both directions.

    Error handling: a handler's RPCError becomes the call's status; any other exception is logged
    with its traceback and answered UNKNOWN. Malformed HTTP/2 or gRPC from the peer raises out of
    serve(), and the caller drops the connection.
    """

    def __init__(self, stream: anyio.abc.ByteStream, services: Mapping[str, purerpc.Service]) -> None:
        super().__init__(stream, _ResetAwareConnection(GRPCConfiguration(client_side=False)))
        self._services = services
        #: Calls in progress on this connection, by HTTP/2 stream id.
        self.calls: dict[int, trio.CancelScope] = {}
        #: Requests still arriving: their headers and the messages so far, by HTTP/2 stream id.
        self._requests: dict[int, tuple[RequestReceived, list[bytes]]] = {}

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
                reset = self._dispatch(events, nursery)
                await self._socket.flush()  # a SETTINGS ack, a PING reply, WINDOW_UPDATEs...
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
                self._requests.pop(event.stream_id, None)
                reset.append(event.stream_id)
            elif isinstance(event, RequestReceived):
                self._allocate_stream(event.stream_id)
                self._requests[event.stream_id] = (event, [])
            elif isinstance(event, MessageReceived):
                # Give the bytes back to the peer's flow-control window (sent by the next flush),
                # or after enough requests it could not send us anything more.
                self._grpc_connection.acknowledge_received_data(event.stream_id, event.flow_controlled_length)
                if (request := self._requests.get(event.stream_id)) is not None:
                    request[1].append(event.data)
            elif isinstance(event, RequestEnded):
                request = self._requests.pop(event.stream_id, None)
                stream = self._streams.get(event.stream_id)
                if request is not None and stream is not None:  # else: a late frame of a reset call
                    stream._close_remote()
                    scope = self.calls[event.stream_id] = trio.CancelScope()
                    nursery.start_soon(self._run_call, stream, scope, *request)
        return reset

    async def _run_call(
        self, stream: GRPCProtoStream, scope: trio.CancelScope, request: RequestReceived, messages: list[bytes]
    ) -> None:
        try:
            with scope:
                await _answer_call(self._services, stream, request, messages)
        finally:
            del self.calls[stream.stream_id]
            _close_event_queues(stream)


async def _answer_call(
    services: Mapping[str, purerpc.Service], stream: GRPCProtoStream, request: RequestReceived, messages: list[bytes]
) -> None:
    """Run one call: find its handler, feed it the request, send what it returns, close with a status."""
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
        if len(messages) != 1:  # grpc-go answers INTERNAL too
            raise RPCError(StatusCode.INTERNAL, f"expected one request message, got {len(messages)}")
        try:
            message = bound.signature.request_type.FromString(messages[0])
        except DecodeError as error:
            raise RPCError(StatusCode.INTERNAL, f"cannot parse the request: {error}") from None
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

    def owns_socket_file(self) -> bool:
        """Whether the socket file is still ours: not deleted, not replaced by another file."""
        return _inode(self.socket_path) == self.inode

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
    # Gone already: a restarting kubelet removes every socket in its directory. Replaced: not ours.
    if server.owns_socket_file():
        with contextlib.suppress(FileNotFoundError):
            os.unlink(server.socket_path)


def _inode(path: str) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


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


@contextlib.contextmanager
def _unwrap_single_errors() -> Iterator[None]:
    """Raise the lone exception inside an exception group as itself.

    anyio's task groups (inside purerpc's sockets) wrap even a single exception, such as the
    caller's own RPCError leaving an ``async with``, in an ExceptionGroup; the caller expects
    the exception it raised.
    """
    try:
        yield
    except BaseExceptionGroup as group:
        error = _innermost(group)
        if error is group:
            raise
        raise error from None


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


@asynccontextmanager
async def open_stream(socket_path: str, method: Method, request: Any, *, timeout: float) -> AsyncIterator[Any]:
    """Start a server-streaming call (ListAndWatch) on a unix socket; yield its responses as they come.

    ``timeout`` bounds connecting only: the stream itself lives until the server ends it, the
    connection breaks, or the caller leaves the ``async with``. Iterating raises RPCError when the
    server ends the stream with an error status or the connection is lost.
    """
    service, _, name = method.path[1:].partition("/")
    try:
        with trio.fail_after(timeout):
            socket_stream = await anyio.connect_unix(socket_path)
    except (OSError, trio.TooSlowError) as error:
        raise RPCError(StatusCode.UNAVAILABLE, f"{method.path} on {socket_path}: {_describe(error)}") from None
    connection = GRPCConnection(GRPCConfiguration(client_side=True))
    with _unwrap_single_errors():
        async with socket_stream, _GRPCSocket(socket_stream, connection) as grpc_socket:
            stream = await grpc_socket.start_request(
                "http", service, name, method.request_type.DESCRIPTOR.full_name, authority="localhost"
            )
            try:
                stream.expect_message_type(method.response_type)
                await stream.send_message(request)
                await stream.close()
                async with contextlib.aclosing(_responses(stream, f"{method.path} on {socket_path}")) as responses:
                    yield responses
            finally:
                _close_event_queues(stream)


async def _responses(stream: GRPCProtoStream, what: str) -> AsyncIterator[Any]:
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
# 6. I/O edges: inotify, registration, the DevicePlugin service
#
# Rules for this section: each piece waits on the kernel (inotify, sockets), never on a timer,
# except the capped backoff between failed registrations. Long-running functions take
# task_status and call started() only once their promise holds.
########################################################################################################

#: Register may take a while: the kubelet dials the plugin back inside the call, allowing that 10 s.
#: A little more than that, so that we report the kubelet's own error instead of our timeout.
REGISTER_TIMEOUT = 15.0

# After a failed Register: retry after 10 ms, doubling up to 5 s. The first retries are quick
# because inotify reports kubelet.sock at bind(), a moment before the kubelet listen()s on it.
_REGISTER_BACKOFF = (0.01, 5.0)

#: The path of the one call a plugin makes to the kubelet.
REGISTER = f"/{API_VERSION}.Registration/Register"

_DIRECTORY_EVENTS = flags.CREATE | flags.DELETE | flags.MOVED_FROM | flags.MOVED_TO | flags.ATTRIB
_GONE = flags.IGNORED | flags.DELETE_SELF | flags.MOVE_SELF


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


class DirectoryWatch:
    """inotify on a directory that may not exist yet, may be deleted, and may come back.

    Besides the directory itself, the nearest existing ancestor is watched, so that the directory
    (or a missing parent) appearing, vanishing or being replaced is seen too; watches are then
    re-armed, because a deleted directory's watch is gone for good (IN_DELETE_SELF, IN_IGNORED).
    Use as a context manager; iterate ``batches()``.
    """

    def __init__(self, path: str, mask: int) -> None:
        self.path = path
        self._mask = mask
        self._inotify = INotify(nonblocking=True)
        self._watches: dict[int, str] = {}  # wd -> "dir" or the name under the ancestor that leads to path
        self.exists = False  #: whether the directory itself is watched right now
        self.arm()

    def __enter__(self) -> DirectoryWatch:
        return self

    def __exit__(self, *exc_info: object) -> None:
        # trio must forget the fd before it is closed, or a task waiting on it would never wake.
        trio.lowlevel.notify_closing(self._inotify.fileno())
        self._inotify.close()

    def arm(self) -> None:
        """(Re)place the watches: on the directory if it exists, and on its nearest existing ancestor."""
        for wd in self._watches:
            try:
                self._inotify.rm_watch(wd)
            except OSError:
                pass  # already removed by the kernel with its directory
        self._watches.clear()
        try:
            self._watches[self._inotify.add_watch(self.path, self._mask | flags.ONLYDIR)] = "dir"
            self.exists = True
        except OSError:
            self.exists = False  # missing, or not a directory: no devices until that changes
        child, ancestor = os.path.basename(self.path), os.path.dirname(self.path)
        while True:
            try:
                mask = flags.CREATE | flags.DELETE | flags.MOVED_FROM | flags.MOVED_TO | _GONE | flags.ONLYDIR
                self._watches[self._inotify.add_watch(ancestor, mask)] = child
                return
            except OSError:
                if ancestor == os.path.dirname(ancestor):
                    return  # not even "/" can be watched: nothing more to do
                child, ancestor = os.path.basename(ancestor), os.path.dirname(ancestor)

    async def batches(self) -> AsyncIterator[tuple[list[tuple[str, int]], bool]]:
        """Yield, for each batch the kernel delivers: the directory's events as (name, mask), and
        whether everything must be rescanned (the directory came or went, or the queue overflowed).
        """
        while True:
            await trio.lowlevel.wait_readable(self._inotify.fileno())
            events, rescan = [], False
            for event in self._inotify.read(timeout=0):
                role = self._watches.get(event.wd)
                if event.mask & flags.Q_OVERFLOW:
                    rescan = True  # the kernel dropped events: only a full rescan is safe
                elif role == "dir" and not event.mask & _GONE:
                    events.append((event.name, event.mask))
                elif role is not None and (role == "dir" or event.mask & _GONE or event.name == role):
                    rescan = True
            if rescan:
                self.arm()
            if events or rescan:
                yield events, rescan


async def watch_devices(
    resource: ResourceConfig, devices: Watched, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Keep ``devices`` (a dict of id -> DeviceEntry) equal to the resource's directory, until cancelled.

    Every batch of inotify events is followed by one rescan, so a burst of changes becomes one
    new device set: ListAndWatch streams send the latest set, never a backlog.
    """
    warned: set[str] = set()

    def rescan() -> None:
        found, skipped = scan_directory(resource.directory, resource.pattern)
        for name in sorted(set(skipped) - warned, key=_natural_key):
            log.warning("%s: skipping %r: a device ID must be 1 to 63 of A-Z a-z 0-9 . _ -", resource.name, name)
        warned.clear()  # warn again about a name only if it goes away and comes back
        warned.update(skipped)
        before = devices.value
        devices.set({device.id: device for device in found})
        if devices.value is not before:
            log.info("%s: %d devices in %s", resource.name, len(found), resource.directory)

    with DirectoryWatch(resource.directory, _DIRECTORY_EVENTS) as watch:
        if not watch.exists:
            log.warning("%s: %s is not a directory (yet): no devices until it is", resource.name, resource.directory)
        rescan()
        task_status.started()
        async for _events, _rescan in watch.batches():
            rescan()


class KubeletWatch:
    """What inotify says about the kubelet's device-plugin directory.

    ``generation`` counts the kubelet.sock files created since we started watching: every kubelet
    (re)start creates one, and each calls for a new registration. ``changed`` is touched on every
    event in the directory, so that each resource can check whether its own socket is still there.
    """

    def __init__(self, device_plugin_dir: str) -> None:
        self.device_plugin_dir = device_plugin_dir
        self.kubelet_socket = os.path.join(device_plugin_dir, KUBELET_SOCKET)
        self.generation = 0
        self.changed = Watched(None)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Watch until cancelled."""
        with DirectoryWatch(
            self.device_plugin_dir, flags.CREATE | flags.DELETE | flags.MOVED_FROM | flags.MOVED_TO
        ) as w:
            inode = _inode(self.kubelet_socket)
            task_status.started()
            async for events, rescan in w.batches():
                created = any(
                    name == KUBELET_SOCKET and mask & (flags.CREATE | flags.MOVED_TO) for name, mask in events
                )
                now = _inode(self.kubelet_socket)
                if created or (rescan and now is not None and now != inode):
                    self.generation += 1
                    log.info("kubelet.sock created in %s: the kubelet (re)started", self.device_plugin_dir)
                inode = now
                self.changed.touch()


def device_plugin_service(resource: ResourceConfig, devices: Watched) -> purerpc.Service:
    """The DevicePlugin service for one resource, answering from the live device set."""

    async def get_device_plugin_options(empty: Any) -> Any:
        return device_plugin_options(resource)

    async def list_and_watch(empty: Any) -> AsyncIterator[Any]:
        # The kubelet keeps this one stream open for as long as we are registered: the full list
        # now, then the full list again after every change. Each message replaces the last.
        current = devices.value
        while True:
            yield list_and_watch_response(current.values())
            log.debug("%s: sent %d devices", resource.name, len(current))
            current = await devices.wait_changed(current)

    async def get_preferred_allocation(request: Any) -> Any:
        return preferred_allocation_response(request)

    async def allocate(request: Any) -> Any:
        response = allocate_response(resource, devices.value, request)
        for container in request.container_requests:
            log.info("%s: allocated %s", resource.name, ",".join(container.devices_ids))
        return response

    async def pre_start_container(request: Any) -> Any:
        return v1beta1.PreStartContainerResponse()

    service = purerpc.Service(f"{API_VERSION}.DevicePlugin")
    for name, handler in {
        "GetDevicePluginOptions": get_device_plugin_options,
        "ListAndWatch": list_and_watch,
        "GetPreferredAllocation": get_preferred_allocation,
        "Allocate": allocate,
        "PreStartContainer": pre_start_container,
    }.items():
        service.add_method(name, handler, METHODS[f"/{API_VERSION}.DevicePlugin/{name}"].signature)
    return service


async def register(
    resource: ResourceConfig, endpoint: str, kubelet: KubeletWatch, still_serving: Callable[[], bool]
) -> int | None:
    """Register ``endpoint`` for ``resource`` with the kubelet, retrying until it succeeds.

    Returns the kubelet generation registered with, or None as soon as ``still_serving()`` turns
    false (a starting kubelet deletes every socket, ours included: serve anew before registering).
    While kubelet.sock is absent, waits for it with inotify; after a failure, retries with a capped
    backoff, at once if a new kubelet.sock appears.
    """
    request = v1beta1.RegisterRequest(
        version=API_VERSION,
        endpoint=endpoint,
        resource_name=resource.name,
        options=device_plugin_options(resource),
    )
    delay, waiting_logged = _REGISTER_BACKOFF[0], False
    while still_serving():
        generation = kubelet.generation
        if not os.path.exists(kubelet.kubelet_socket):
            if not waiting_logged:
                log.info("%s: waiting for the kubelet: no %s yet", resource.name, kubelet.kubelet_socket)
                waiting_logged = True
            await kubelet.changed.wait_touched()
            continue
        try:
            await call_unary(kubelet.kubelet_socket, METHODS[REGISTER], request, timeout=REGISTER_TIMEOUT)
            return generation
        except RPCError as error:
            # Right after kubelet.sock appears, connecting can be refused for a moment: not worth a warning.
            level = logging.DEBUG if error.code == StatusCode.UNAVAILABLE and delay < 0.5 else logging.WARNING
            log.log(level, "%s: registration failed, retrying in %.2g s: %s", resource.name, delay, error)
        with trio.move_on_after(delay):
            while kubelet.generation == generation and still_serving():
                await kubelet.changed.wait_touched()
        delay = min(delay * 2, _REGISTER_BACKOFF[1])
    return None


########################################################################################################
# 7. Orchestration: the nursery tree
#
#   serve_plugin
#   ├── KubeletWatch.run                         inotify on the device-plugin directory
#   └── per resource:
#       ├── watch_devices                        inotify on the resource's directory
#       └── serve_resource                       one generation at a time:
#           └── serve_grpc (socket N)            serve, register, wait for a kubelet restart
#                                                or our socket's deletion, stop, N + 1
########################################################################################################


def socket_name(resource: ResourceConfig, generation: int) -> str:
    """The socket file for one registration: fresh per registration, never hidden.

    Old kubelets key a registration by resource name; a new name per registration keeps a closing
    old stream from taking the new registration down with it.
    """
    return f"gopherplug-{resource.name.replace('/', '_')}-{generation}.sock"


async def serve_resource(
    resource: ResourceConfig,
    devices: Watched,
    kubelet: KubeletWatch,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve and register one resource, again after every kubelet restart, until cancelled.

    started() is called once the first socket is listening (registration may still be waiting
    for the kubelet).
    """
    directory = kubelet.device_plugin_dir
    for generation in itertools.count(1):
        while not os.path.isdir(directory):
            log.warning("%s: waiting for the kubelet's directory %s to exist", resource.name, directory)
            await kubelet.changed.wait_touched()
        endpoint = socket_name(resource, generation)
        async with trio.open_nursery() as nursery:
            try:
                server = await nursery.start(
                    serve_grpc, os.path.join(directory, endpoint), [device_plugin_service(resource, devices)]
                )
            except FileNotFoundError:
                continue  # the directory vanished between the check and bind(): wait for it again
            except OSError as error:
                raise GopherplugError(f"{resource.name}: cannot serve on {directory}: {_describe(error)}") from None
            task_status.started()
            # The kubelet dials us back before Register returns: we are serving already.
            registered_with = await register(resource, endpoint, kubelet, server.owns_socket_file)
            if registered_with is not None:
                log.info("%s: registered with the kubelet as %s", resource.name, endpoint)
                while kubelet.generation == registered_with and server.owns_socket_file():
                    await kubelet.changed.wait_touched()
            why = "our socket was deleted" if not server.owns_socket_file() else "the kubelet restarted"
            log.info("%s: %s: serving and registering again", resource.name, why)
            # Stop this server before the next registration: its ListAndWatch stream ends now.
            nursery.cancel_scope.cancel()
        task_status = trio.TASK_STATUS_IGNORED


async def serve_plugin(config: Config, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Run the device plugin for every resource of ``config`` until cancelled.

    The library entry point: an embedding program starts it in its own nursery
    (``await nursery.start(serve_plugin, config)``) and cancels that nursery to stop it. started()
    is called once every resource's socket is listening. No signal handling here: that belongs to
    the program (see main()).

    Resource handling: sockets are removed on the way out, whatever the reason.
    Error handling: kubelet absence, restarts and refusals are logged and retried; only an error
    the plugin cannot recover from (e.g. no permission to create its socket) raises.
    """
    kubelet = KubeletWatch(config.device_plugin_dir)
    async with trio.open_nursery() as nursery:
        await nursery.start(kubelet.run)
        for resource in config.resources:
            devices = Watched({})
            await nursery.start(watch_devices, resource, devices)
            await nursery.start(serve_resource, resource, devices, kubelet)
        task_status.started()


########################################################################################################
# 8. A kubelet simulator
#
# The kubelet's device manager, reduced to what a plugin can observe (see the README's lesson):
# it wipes the sockets of its directory on start, serves Registration on kubelet.sock, validates
# Register and dials the plugin back *before* answering, keeps one ListAndWatch stream per
# resource, marks every device unhealthy when that stream ends, and calls Allocate and
# GetPreferredAllocation on demand. gopherplug's own tests use it, and so can a plugin author's.
########################################################################################################

#: How long the kubelet waits to dial a registering plugin back.
KUBELET_DIAL_TIMEOUT = 10.0


@dataclass
class SimulatedResource:
    """What the simulated kubelet knows of one registered resource."""

    endpoint: str  #: the socket file name the plugin registered
    options: Any  #: what GetDevicePluginOptions answered during Register
    devices: dict[str, str]  #: device ID -> health, from the latest ListAndWatch message
    updates: int = 0  #: ListAndWatch messages received since this registration
    streaming: bool = False  #: whether the ListAndWatch stream is open

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
    ``wait_until(predicate)`` waits (without polling) until ``predicate(simulator)`` holds.
    """

    def __init__(self, device_plugin_dir: str) -> None:
        self.device_plugin_dir = device_plugin_dir
        self.socket_path = os.path.join(device_plugin_dir, KUBELET_SOCKET)
        self.resources: dict[str, SimulatedResource] = {}  #: by resource name
        self.registrations: list[Any] = []  #: every accepted RegisterRequest, in order
        self.refusals: list[str] = []  #: the error of every refused Register, in order
        self.starts = 0  #: how many times the simulated kubelet started
        self._changed = Watched(None)
        self._restart = trio.Event()
        self._streams: dict[str, trio.CancelScope] = {}

    async def run(self, *, task_status: trio.TaskStatus[KubeletSimulator] = trio.TASK_STATUS_IGNORED) -> None:
        """Be the kubelet until cancelled; started() once kubelet.sock listens."""
        while True:
            self._wipe_sockets()
            self._restart = trio.Event()
            self._streams.clear()
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                await nursery.start(serve_grpc, self.socket_path, [self._registration_service()])
                self.starts += 1
                self._changed.touch()
                task_status.started(self)
                task_status = trio.TASK_STATUS_IGNORED
                await self._restart.wait()
                nursery.cancel_scope.cancel()

    def restart(self) -> None:
        """Restart like the kubelet: drop every stream, delete every socket, serve kubelet.sock again."""
        self._restart.set()

    async def wait_until(self, predicate: Callable[[KubeletSimulator], bool]) -> None:
        """Return once ``predicate(self)`` is true; checked after every change the simulator sees."""
        while not predicate(self):
            await self._changed.wait_touched()

    async def allocate(self, resource_name: str, device_ids: Iterable[str]) -> Any:
        """Call Allocate for one container, as the kubelet does while admitting a pod."""
        request = v1beta1.AllocateRequest(container_requests=[v1beta1.ContainerAllocateRequest(devices_ids=device_ids)])
        return await self._call(resource_name, "Allocate", request)

    async def preferred_allocation(
        self, resource_name: str, available: Iterable[str], must_include: Iterable[str], size: int
    ) -> list[str]:
        """Call GetPreferredAllocation for one container and return the plugin's pick."""
        request = v1beta1.PreferredAllocationRequest(
            container_requests=[
                v1beta1.ContainerPreferredAllocationRequest(
                    available_deviceIDs=available, must_include_deviceIDs=must_include, allocation_size=size
                )
            ]
        )
        response = await self._call(resource_name, "GetPreferredAllocation", request)
        return list(response.container_responses[0].deviceIDs)

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

    def _registration_service(self) -> purerpc.Service:
        async def register_handler(request: Any) -> Any:
            try:
                return await self._register(request)
            except RPCError as error:
                self.refusals.append(error.message)
                self._changed.touch()
                raise

        service = purerpc.Service(f"{API_VERSION}.Registration")
        service.add_method("Register", register_handler, METHODS[REGISTER].signature)
        return service

    async def _register(self, request: Any) -> Any:
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
        try:
            options = await call_unary(
                endpoint,
                METHODS[f"/{API_VERSION}.DevicePlugin/GetDevicePluginOptions"],
                v1beta1.Empty(),
                timeout=KUBELET_DIAL_TIMEOUT,
            )
        except RPCError as error:
            raise RPCError(StatusCode.UNKNOWN, f"failed to dial device plugin: {error.message}") from None
        old = self._streams.pop(request.resource_name, None)
        if old is not None:
            old.cancel()  # a new registration replaces the old endpoint
        resource = SimulatedResource(request.endpoint, options, {})
        self.resources[request.resource_name] = resource
        self.registrations.append(request)
        scope = self._streams[request.resource_name] = trio.CancelScope()
        self._nursery.start_soon(self._list_and_watch, resource, endpoint, scope)
        self._changed.touch()
        return v1beta1.Empty()

    async def _list_and_watch(self, resource: SimulatedResource, endpoint: str, scope: trio.CancelScope) -> None:
        method = METHODS[f"/{API_VERSION}.DevicePlugin/ListAndWatch"]
        with scope:
            try:
                async with open_stream(endpoint, method, v1beta1.Empty(), timeout=KUBELET_DIAL_TIMEOUT) as responses:
                    resource.streaming = True
                    self._changed.touch()
                    async for response in responses:
                        resource.devices = {device.ID: device.health for device in response.devices}
                        resource.updates += 1
                        self._changed.touch()
            except RPCError as error:
                log.debug("simulated kubelet: ListAndWatch on %s ended: %s", endpoint, error)
            finally:
                # The stream is gone: every device of the resource turns unhealthy at once.
                resource.streaming = False
                resource.devices = dict.fromkeys(resource.devices, UNHEALTHY)
                self._changed.touch()


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


async def run_demo(out: Callable[[str], None] = print) -> None:
    """Run the plugin against the kubelet simulator in a temporary directory, telling each step.

    Leaves nothing behind: the directory, its sockets and its files are gone when this returns.
    """
    root = tempfile.mkdtemp(prefix="gopherplug-demo-")
    try:
        plugin_dir, devices = os.path.join(root, "device-plugins"), os.path.join(root, "gophers")
        os.mkdir(plugin_dir)
        os.mkdir(devices)
        for name in ("gopher0", "gopher1", "gopher2"):
            open(os.path.join(devices, name), "x").close()
        config = parse_config(DEMO_CONFIG.format(devices=devices), "<demo>")
        config = dataclasses.replace(config, device_plugin_dir=plugin_dir)
        await _narrate_demo(config, devices, out)
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def _narrate_demo(config: Config, devices: str, out: Callable[[str], None]) -> None:
    resource = config.resources[0].name
    start = trio.current_time()

    def say(who: str, what: str) -> None:
        out(f"{(trio.current_time() - start) * 1e3:8.1f} ms  {who:<8} {what}")

    def listed(kubelet: KubeletSimulator) -> str:
        known = kubelet.resources[resource].devices
        return ", ".join(f"{device_id} {health}" for device_id, health in known.items()) or "none"

    async def wait_for(what: str, predicate: Callable[[KubeletSimulator], bool]) -> None:
        with trio.move_on_after(DEMO_STEP_TIMEOUT):
            await kubelet.wait_until(predicate)
            return
        raise GopherplugError(f"demo: {what} did not happen within {DEMO_STEP_TIMEOUT:.0f} s")

    out(f"gopherplug demo: a simulated kubelet and the real plugin, in {os.path.dirname(devices)}")
    async with trio.open_nursery() as nursery:
        kubelet = await nursery.start(KubeletSimulator(config.device_plugin_dir).run)
        say("kubelet", f"serving Registration on {kubelet.socket_path} (sockets of the directory wiped)")
        await nursery.start(serve_plugin, config)
        say("plugin", f"watching {devices}; serving DevicePlugin on a socket in {config.device_plugin_dir}")
        await wait_for("registration", lambda k: bool(k.registrations))
        registration = kubelet.registrations[-1]
        say(
            "plugin", f"Register(resource {resource}, endpoint {registration.endpoint}, version {registration.version})"
        )
        say(
            "kubelet",
            f"dialed {registration.endpoint} back before answering: {_one_line(kubelet.resources[resource].options)}",
        )
        say("kubelet", "registration accepted; opening ListAndWatch")
        await wait_for("the first device list", lambda k: k.resources[resource].updates > 0)
        say("plugin", f"ListAndWatch: {listed(kubelet)}")
        say("kubelet", f"node capacity {resource}: {kubelet.resources[resource].capacity}")

        ids = sorted(kubelet.resources[resource].devices, key=_natural_key)[:2]
        say("kubelet", f"a pod asks for 2 {resource}: Allocate({', '.join(ids)})")
        answer = (await kubelet.allocate(resource, ids)).container_responses[0]
        for name, value in sorted(answer.envs.items()):
            say("plugin", f"  env {name}={value}")
        for spec in answer.devices:
            say("plugin", f"  device {spec.host_path} -> {spec.container_path} ({spec.permissions})")

        added = os.path.join(devices, "gopher3")
        open(added, "x").close()
        touched = trio.current_time()
        say("demo", f"created {added}")
        await wait_for("the new device's update", lambda k: "gopher3" in k.resources[resource].devices)
        say("plugin", f"ListAndWatch: {listed(kubelet)} ({(trio.current_time() - touched) * 1e3:.1f} ms later)")

        registrations = len(kubelet.registrations)
        restarted = trio.current_time()
        kubelet.restart()
        say("kubelet", "restarted: every socket in its directory deleted, kubelet.sock served again")
        await wait_for(
            "re-registration",
            lambda k: len(k.registrations) > registrations and len(k.resources[resource].devices) == 4,
        )
        say(
            "plugin",
            f"saw the new kubelet.sock, registered again as {kubelet.registrations[-1].endpoint}: "
            f"{(trio.current_time() - restarted) * 1e3:.1f} ms",
        )
        say("plugin", f"ListAndWatch: {listed(kubelet)}")
        nursery.cancel_scope.cancel()
    say("demo", "done: plugin stopped, its sockets removed")


def _one_line(message: Any) -> str:
    return text_format.MessageToString(message, as_one_line=True) or "(defaults)"


########################################################################################################
# 9. Command line
#
# Rules for this section: parse, validate everything, then run; return an exit code: 0 on a
# requested shutdown, 2 on bad usage or configuration, 1 on a runtime failure. Signals are handled
# here and only here.
########################################################################################################

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


def load_config(path: str, device_plugin_dir: str | None = None) -> Config:
    """Read and validate a configuration file; ``device_plugin_dir``, if given, overrides the file's."""
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(path, "", f"cannot read: {_describe(error)}") from None
    config = parse_config(text, path)
    if device_plugin_dir is not None:
        if not os.path.isabs(device_plugin_dir):
            raise ConfigError("--device-plugin-dir", "", f"{device_plugin_dir!r} must be an absolute path")
        config = dataclasses.replace(config, device_plugin_dir=os.path.normpath(device_plugin_dir))
    return config


def _parser() -> argparse.ArgumentParser:
    env = os.environ.get
    parser = argparse.ArgumentParser(
        prog="gopherplug",
        description="A Kubernetes device plugin: the entries of a directory become schedulable devices.",
        epilog="Without a command, runs `serve`.",
    )
    parser.add_argument("--version", action="version", version=f"gopherplug {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="{serve,check-config,demo}")
    serve = commands.add_parser("serve", help="run the device plugin (the default)")
    check = commands.add_parser("check-config", help="validate a configuration file and summarise it")
    demo = commands.add_parser(
        "demo", help="run the plugin against a simulated kubelet in a temporary directory, step by step"
    )
    for command in (serve, check):
        command.add_argument(
            "--config",
            default=env("GOPHERPLUG_CONFIG"),
            metavar="FILE",
            help="configuration file (env GOPHERPLUG_CONFIG)",
        )
    serve.add_argument(
        "--device-plugin-dir",
        default=env("GOPHERPLUG_DEVICE_PLUGIN_DIR"),
        metavar="DIR",
        help="the kubelet's device-plugin directory, overriding the file's (env GOPHERPLUG_DEVICE_PLUGIN_DIR)",
    )
    for command, default in ((serve, "info"), (demo, "warning")):
        command.add_argument(
            "--log-level",
            default=env("GOPHERPLUG_LOG_LEVEL", default),
            type=str.lower,
            choices=["debug", "info", "warning", "error"],
            help=f"log level (env GOPHERPLUG_LOG_LEVEL, default {default})",
        )
    return parser


def main(argv: list[str] | None = None) -> int:
    """The ``gopherplug`` command. Returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in {"serve", "check-config", "demo", "-h", "--help", "--version"}:
        argv.insert(0, "serve")  # serve is the default command
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse has printed the usage error (or the help)
        return exit_.code if isinstance(exit_.code, int) else EXIT_USAGE
    if args.command == "demo":
        return _run(args.log_level, run_demo)
    if not args.config:
        print("gopherplug: no configuration: give --config FILE or set GOPHERPLUG_CONFIG", file=sys.stderr)
        return EXIT_USAGE
    try:
        config = load_config(args.config, getattr(args, "device_plugin_dir", None))
    except ConfigError as error:
        print(f"gopherplug: {error}", file=sys.stderr)
        return EXIT_USAGE
    if args.command == "check-config":
        names = ", ".join(f"{r.name} ({r.directory}/{r.pattern})" for r in config.resources)
        print(
            f"{config.source}: OK: {len(config.resources)} resource(s): {names}; kubelet at {config.device_plugin_dir}"
        )
        return EXIT_OK
    return _run(args.log_level, _serve_until_signalled, config)


def _run(log_level: str, main_task: Callable[..., Awaitable[None]], *args: Any) -> int:
    """Run ``main_task(*args)`` under trio; a GopherplugError becomes one logged line and exit 1."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    try:
        trio.run(main_task, *args)
    except Exception as error:
        if not isinstance(_innermost(error), GopherplugError):
            raise
        log.error("%s", _innermost(error))
        return EXIT_FAILURE
    return EXIT_OK


async def _serve_until_signalled(config: Config) -> None:
    # SIGTERM (the kubelet deleting the pod, docker stop) and SIGINT (Ctrl-C) are requests to stop:
    # cancelling the nursery runs every `finally`, which removes our sockets.
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve_plugin, config)
            async for signum in signals:
                log.info("%s received: stopping", signal.Signals(signum).name)
                nursery.cancel_scope.cancel()
                break


if __name__ == "__main__":
    # Run as a script, this file is both __main__ and (for anything importing it) gopherplug:
    # register it under its own name so that there is one module object, not two.
    sys.modules.setdefault("gopherplug", sys.modules[__name__])
    sys.exit(main())
