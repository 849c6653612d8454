"""What several test files share: helpers, stand-ins' drivers, constants (fixtures: conftest.py)."""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import functools
import json
import logging
import os
import re
import shutil
import socket
import ssl
import stat
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
import trio
import trio.socket
import trio.testing
import yaml
from hypothesis import HealthCheck, settings
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


def in_thread(fn, *args, **kwargs):
    return trio.to_thread.run_sync(lambda: fn(*args, **kwargs))


def allocate_request(pb2, *ids):
    return pb2.AllocateRequest(container_requests=[pb2.ContainerAllocateRequest(devices_ids=list(ids))])


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


MINIMAL = "resources:\n  - name: example.com/gopher\n    directory: /etc/gophers\n"


def deleted_message(directory):
    return (
        f"the device-plugin directory {directory} was removed on the host, and this container still sees the "
        "deleted one through its hostPath mount: exiting, so that the kubelet restarts it with a fresh mount"
    )


def resources(**fields):
    """A one-resource config as YAML text, with `fields` merged into the resource."""
    return yaml.safe_dump({"resources": [{"name": "example.com/gopher", "directory": "/g", **fields}]})


def resource_in(directory, **fields):
    """The one resource of a config with `fields`, its directory set to `directory`."""
    text = yaml.safe_dump({"resources": [{"name": "example.com/gopher", "directory": str(directory), **fields}]})
    return gp.parse_config(text, "c").resources[0]


def fake_sysfs(root, nodes):
    """A sysfs tree with /sys/dev/char/MAJ:MIN/device/numa_node for each (major, minor) -> node."""
    for (major, minor), node in nodes.items():
        device = root / "dev" / "char" / f"{major}:{minor}" / "device"
        device.mkdir(parents=True)
        (device / "numa_node").write_text(f"{node}\n")
    return str(root)


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


def config_with(top=(), **fields):
    """A configuration of one resource with exactly `fields` (and `top`-level keys)."""
    document = {**dict(top), "resources": [{"name": "example.com/gopher", **fields}]}
    return gp.parse_config(yaml.safe_dump(document), "c")


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


def usb_nodes(dev, *names):
    """Device nodes under the fake /dev, as devtmpfs makes them when a USB device is plugged in."""
    for number, name in enumerate(names):
        make_node(f"{dev}/{name}", 189 if name.startswith("bus/") else 241, number)


def allocate(resource, devices, *ids):
    by_id = {d.id: d for d in devices}
    request = v1beta1.AllocateRequest(container_requests=[v1beta1.ContainerAllocateRequest(devices_ids=ids)])
    return gp.allocate_response(resource, by_id, request)


def host_mode(path):
    """What a CDI spec's device node says of its host file: its mode without the type bits, and owner."""
    status = os.stat(path)
    return {"fileMode": stat.S_IMODE(status.st_mode), "uid": status.st_uid, "gid": status.st_gid}


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


# In CI (CI=true) the examples are derandomized: the same inputs on every run, so a submission
# lands or not on its own merits. Locally they vary, and HYPOTHESIS_EXAMPLES=5000 searches harder.
PROPERTIES = settings(
    max_examples=int(os.environ.get("HYPOTHESIS_EXAMPLES", "300")),
    deadline=None,
    derandomize=bool(os.environ.get("CI")),
    suppress_health_check=[HealthCheck.too_slow],
)


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


class HungMount:
    """A FUSE file system mounted at ``path`` whose daemon never answers, as a dead NFS server or a hung
    FUSE daemon leaves one on a node: every lookup under it (stat, open, add_watch of a directory in
    it) waits, in the kernel, until release() closes the daemon's end; then it, and each one after,
    fails with ENOTCONN. /proc/self/mountinfo stays readable. A watchdog releases it after TIMEOUT,
    should a lookup block the test's own event loop. Needs root and /dev/fuse (the hung_mount fixture
    skips without them)."""

    def __init__(self, path):
        self.path = str(path)
        self._libc = ctypes.CDLL(None, use_errno=True)
        os.makedirs(self.path, exist_ok=True)
        self._fd, self._lock = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC), threading.Lock()
        options = f"fd={self._fd},rootmode=40000,user_id=0,group_id=0".encode()  # (rootmode: a directory)
        if self._libc.mount(b"gopherplug-hung", self.path.encode(), b"fuse", 0, options) != 0:
            error = ctypes.get_errno()
            os.close(self._fd)
            raise OSError(error, f"cannot mount a FUSE file system at {self.path}: {os.strerror(error)}")
        self._watchdog = threading.Timer(TIMEOUT, self.release)
        self._watchdog.start()

    def release(self):
        """The daemon gone: what waits under the mount fails with ENOTCONN, and so does what comes after."""
        with self._lock:
            fd, self._fd = self._fd, -1
            if fd >= 0:
                os.close(fd)

    def remove(self):
        self._watchdog.cancel()
        self.release()
        self._libc.umount2(self.path.encode(), 2)  # MNT_DETACH


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


def listed_ids(*ids):
    return dict.fromkeys(ids, gp.HEALTHY)


def dataclasses_replace_dir(config, directory):
    return dataclasses.replace(config, resources=(dataclasses.replace(config.resources[0], directory=directory),))


OTHER = "example.com/other"


def config_text(node, **resources):
    """A configuration with the given resources: name -> extra keys."""
    entries = [{"name": name, "directory": node.devices, **keys} for name, keys in resources.items()]
    return yaml.safe_dump({"device_plugin_dir": node.plugin_dir, "resources": entries})


def streaming(simulator, name):
    resource = simulator.resources.get(name)
    return resource.devices if resource is not None and resource.streaming else None


def replace_file(path, text):
    """Give the file at ``path`` the content ``text`` (str or bytes) whole: written beside it, then
    renamed over it, as the kubelet swaps a ConfigMap's file (a symlink renamed over). Written in
    place, a watched file can be read between the truncation and the write (empty), when a read
    the watch started for an earlier event runs in its worker thread meanwhile."""
    path = Path(path)
    new = path.with_name(f".{path.name}.new")  # a hidden name: the watch reads the file again, the same
    if isinstance(text, bytes):
        new.write_bytes(text)
    else:
        new.write_text(text)
    os.replace(new, path)


async def reloading(nursery, node, path):
    simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
    config = gp.load_config(str(path))
    updates = lambda current: gp.watch_config_file(str(path), current=current)  # noqa: E731 - one a run
    await nursery.start(functools.partial(gp.serve_plugin, config, updates=updates))
    await simulator.wait_until(listed("g1", "g2"))
    return simulator


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


def health_of(simulator):
    return devices_of(simulator) or {}


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


def read_spec(path):
    with open(path, encoding="utf-8") as file:
        return json.load(file)


def widgets(simulator):
    found = simulator.resources.get("example.com/widget")
    return found.devices if found is not None and found.streaming else None


WIDGET = "example.com/widget"


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


ERROR = "claim default/demo-hailo: selector #0: CEL runtime error: "


async def run_cli_async(*args, env=None):
    """run_cli for tests whose plugin runs on this trio thread: the subprocess is awaited, not blocked on."""
    return await trio.run_process(
        [sys.executable, str(HERE / "gopherplug.py"), *args],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
        env={**os.environ, **(env or {})},
    )


async def read_until(stream, text, seen):
    """Read a process's output into ``seen`` (a bytearray) until ``text`` has appeared in it."""
    while text.encode() not in seen:
        chunk = await stream.receive_some()
        assert chunk, f"the process ended before saying {text!r}: {seen.decode(errors='replace')}"
        seen += chunk


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


NVIDIA = HERE / "examples" / "nvidia"


NVIDIA_DATA = NVIDIA / "testdata"


#: `nvidia-smi --query-gpu=index,uuid,name,memory.total [MiB],pci.bus_id,driver_version,compute_cap,
#: serial,mig.mode.current,power.limit --format=csv` on a real H200 node (driver 580.159.04).
H200_RECORDING = NVIDIA_DATA / "h200-query-gpu.csv"


#: The same node's /proc/driver/nvidia/gpus/0000:00:06.0/information.
H200_INFORMATION = NVIDIA_DATA / "h200-information.txt"


#: The nodes of a GPU node: (major, minor) as /proc/devices and `ls -l /dev/nvidia*` showed them.
NVIDIA_CTL, NVIDIA_UVM, NVIDIA_UVM_TOOLS = (195, 255), (238, 0), (238, 1)


NVIDIA_SHARED = {"nvidiactl": NVIDIA_CTL, "nvidia-uvm": NVIDIA_UVM, "nvidia-uvm-tools": NVIDIA_UVM_TOOLS}


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


def check(*argv):
    """Run a checking tool installed with the test extra (next to this Python), from the repository."""
    tool = Path(sys.executable).parent / argv[0]
    return subprocess.run([str(tool), *argv[1:]], cwd=HERE, capture_output=True, text=True, timeout=300, check=False)


def helm_template(helm, values, release="gopherplug", *more):
    """`helm template` of the chart from the repository, in kube-system, as the README's commands run it."""
    argv = [helm, "template", release, "chart/gopherplug", "--namespace", "kube-system", "-f", values, *more]
    return subprocess.run(argv, cwd=HERE, capture_output=True, text=True, timeout=120, check=False)


_GOPHER = {"name": "example.com/gopher", "directory": "/dev", "pattern": "gopher*"}


def _gopher(**keys):
    return {**_GOPHER, **keys}


DRIVER = "gopherplug.example.com"


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


POD_UID = "6f1e3c2a-9b7d-4e5f-8a1c-0d2b3e4f5a6b"


SHARE_1 = "5b0e1c2a-8f4d-4c3e-9a1b-0d2e3f4a5b61"


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


BUG = "held back; a bug in gopherplug, please report it (its traceback is logged at log level debug)"


def program_file(directory, text, name="describe"):
    script = Path(directory, name)
    script.write_text(text.replace("{python}", sys.executable))
    script.chmod(0o755)
    return str(script)


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


def stopped(*parts):
    """The trace of parts that stopped in time: "waiting", then "done", each."""
    return [(DEBUG, f"stop: {part}: {what}") for part in parts for what in ("waiting", "done")]


DEBUG, WARNING = "DEBUG", "WARNING"


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
