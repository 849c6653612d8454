"""Lesson 2, the device plugin: the "Gopher" tutorial's plugin, done right, in one sitting.

The devices of lesson 1 (gopher_devices.py: read it first) become the resource example.com/gopher.
The plugin serves the kubelet's DevicePlugin API (v1beta1) on a unix socket, registers through
kubelet.sock, streams the device list as entries come and go, answers Allocate, and registers
again whenever the kubelet restarts. Read it top to bottom:

  1. The service    GetDevicePluginOptions, ListAndWatch, Allocate: one method each
  2. The kubelet    serve a socket, Register, and again after each kubelet restart
  3. The demo       `python gopher_plugin.py --demo`: gopherplug's kubelet simulator, narrated

Lesson 3 (gopher_allocation.py) adds what a plugin may offer besides: GetPreferredAllocation,
PreStartContainer, TopologyInfo and CDI. gopherplug gives the lessons the v1beta1 messages and
the gRPC-over-unix-socket glue (serve_grpc, call_unary, Watched); the protocol is all here.
gopherplug.py is the same, grown up: docs/protocol.md.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from typing import Any

import trio
from gopher_devices import Gopher, health, read_events, say, scan, watch_devices
from inotify_simple import INotify, flags

from gopherplug import METHODS, KubeletSimulator, RPCError, StatusCode, Watched, call_unary, serve_grpc, v1beta1

# The contract (k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1): its version, the kubelet's socket.
API_VERSION, KUBELET_SOCKET = "v1beta1", "kubelet.sock"
RESOURCE = "example.com/gopher"


# 1. The service. The kubelet calls these on our socket; each method is one RPC of v1beta1.
class GopherPlugin:
    RPCS: tuple[str, ...] = ("GetDevicePluginOptions", "ListAndWatch", "Allocate")  # lesson 3 adds 2

    def __init__(self, directory: str, devices: Watched) -> None:
        self.directory, self.devices = directory, devices

    async def GetDevicePluginOptions(self, empty: Any) -> Any:  # noqa: N802 - the RPC's name
        # The kubelet calls this while handling our Register, before it answers: our socket must
        # already be serving. It keeps the answer for as long as the registration lives. Here:
        # neither PreStartContainer nor GetPreferredAllocation, so the kubelet never calls them.
        return v1beta1.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=False)

    async def ListAndWatch(self, empty: Any) -> AsyncIterator[Any]:  # noqa: N802
        # The kubelet opens one stream right after Register and keeps it open for as long as the
        # registration lives. Each message is the WHOLE list: it replaces the one before (a device
        # left out is gone). If the stream ends, the kubelet marks every device unhealthy at once,
        # so it must not end. An empty list is a fine answer: the node has none, for now.
        current = self.devices.value
        while True:
            yield v1beta1.ListAndWatchResponse(devices=[self.device(id_, gopher) for id_, gopher in current.items()])
            current = await self.devices.wait_changed(current)

    def device(self, device_id: str, gopher: Gopher) -> Any:
        return v1beta1.Device(ID=device_id, health=gopher.health)

    async def Allocate(self, request: Any) -> Any:  # noqa: N802
        # Once per container the kubelet admits, with the IDs it chose from our healthy ones (the
        # scheduler only counted them). What we answer is what the runtime gives the container:
        # device nodes (DeviceSpecs), env, mounts. An error fails the pod for good
        # (UnexpectedAdmissionError): the kubelet does not ask again.
        answers = [self.allocate_container(list(container.devices_ids)) for container in request.container_requests]
        return v1beta1.AllocateResponse(container_responses=answers)

    def check(self, device_id: str) -> str:
        # Look again, not at our last list: the entry may have gone or turned unhealthy since.
        path = os.path.join(self.directory, device_id)
        if device_id not in self.devices.value or not os.path.lexists(path):
            raise RPCError(StatusCode.INVALID_ARGUMENT, f"unknown device {device_id}")
        if health(path) != "Healthy":
            raise RPCError(StatusCode.FAILED_PRECONDITION, f"device {device_id} is unhealthy")
        return path

    def allocate_container(self, device_ids: list[str]) -> Any:
        answer = v1beta1.ContainerAllocateResponse()
        for device_id in device_ids:
            # host_path is opened by the runtime on the host: the symlink's target, not the link.
            target = os.path.realpath(self.check(device_id))
            answer.devices.add(host_path=target, container_path=f"/dev/{device_id}", permissions="rw")
        answer.envs["GOPHER_DEVICES"] = ",".join(device_ids)
        return answer

    def service(self) -> Any:
        import purerpc  # after gopherplug, whose glue lets purerpc 0.8 run on h2 4

        service = purerpc.Service(f"{API_VERSION}.DevicePlugin")
        for name in self.RPCS:
            service.add_method(name, getattr(self, name), METHODS[f"/{API_VERSION}.DevicePlugin/{name}"].signature)
        return service


# 2. The kubelet. It owns its directory: at every start it deletes every socket in it (ours too)
# and creates kubelet.sock anew. It never tells a plugin it restarted, and never dials a plugin it
# has forgotten. So we watch the directory, and a new kubelet.sock (a new inode) means: serve a
# fresh socket and Register again. The tutorial's plugin registers once and is lost for good.


def inode(path: str) -> int | None:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None


async def register(kubelet_socket: str, endpoint: str) -> None:
    # The kubelet.sock inotify shows may not listen yet (it is created at bind, before listen):
    # retry, from 10 ms doubling to 5 s. The kubelet dials `endpoint` back before answering.
    request = v1beta1.RegisterRequest(version=API_VERSION, endpoint=endpoint, resource_name=RESOURCE)
    delay = 0.01
    while True:
        try:
            await call_unary(kubelet_socket, METHODS[f"/{API_VERSION}.Registration/Register"], request, timeout=15)
            return
        except RPCError as error:
            say("plugin", f"Register: no answer yet ({error.message}); again in {delay:g} s")
            await trio.sleep(delay)
            delay = min(delay * 2, 5.0)


async def serve(
    directory: str,
    plugin_dir: str,
    plugin: type[GopherPlugin] = GopherPlugin,
    *,
    task_status: Any = trio.TASK_STATUS_IGNORED,
) -> None:
    devices = Watched(scan(directory))
    kubelet_socket = os.path.join(plugin_dir, KUBELET_SOCKET)
    with INotify() as kubelet:
        try:
            kubelet.add_watch(plugin_dir, flags.CREATE | flags.DELETE)  # before anything can happen there
        except OSError as error:  # the kubelet makes it: a node without one has no kubelet to serve
            raise SystemExit(
                f"{plugin_dir}: {error.strerror}: is the kubelet's device-plugin directory here?"
            ) from None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_devices, directory, devices)
            for generation in itertools.count(1):
                while (registered_with := inode(kubelet_socket)) is None:  # no kubelet yet: wait for one
                    await read_events(kubelet)
                endpoint = f"gopher-{generation}.sock"  # a new name each time: never the old socket's
                async with trio.open_nursery() as server:
                    # Serve first, then Register: the kubelet dials us back before it answers.
                    service = plugin(directory, devices).service()
                    await server.start(serve_grpc, os.path.join(plugin_dir, endpoint), [service])
                    say("plugin", f"Register({RESOURCE}, endpoint {endpoint}, version {API_VERSION})")
                    await register(kubelet_socket, endpoint)
                    task_status.started()
                    task_status = trio.TASK_STATUS_IGNORED
                    # Until our socket is deleted (the kubelet wipes its directory as it starts),
                    # or a kubelet.sock other than the one we registered with appears.
                    while not any(
                        (event.name == endpoint and event.mask & flags.DELETE)
                        or (event.name == KUBELET_SOCKET and inode(kubelet_socket) not in (None, registered_with))
                        for event in await read_events(kubelet)
                    ):
                        pass
                    say("plugin", "the kubelet restarted: a new socket, a new Register")
                    # Stop the old server first: when a stream ends, the kubelet drops whichever plugin is
                    # registered under the name *then* (gopherplug waits for it to: serve_resource).
                    server.cancel_scope.cancel()


# 3. The demo: gopherplug's kubelet simulator, as strict as the kubelet, and this plugin.


def said(options: Any) -> str:
    return ", ".join(f"{field.name} {value}" for field, value in options.ListFields()) or "all False"


def plug(root: str, *names: str) -> None:
    """Make root/gophers with these gophers at once, as udev makes /dev/serial/by-id at a plug."""
    aside = os.path.join(root, ".new")
    os.mkdir(aside)
    for number, name in enumerate(names):
        with open(os.path.join(aside, name), "x", encoding="utf-8") as gopher:
            model = "giant" if number >= 2 else "pocket"  # lesson 1: the lines play sysfs
            gopher.write(f"numa={number % 2}\nmemory={number + 1}Gi\nmodel={model}\n")
    os.rename(aside, os.path.join(root, "gophers"))


async def demo() -> None:
    with tempfile.TemporaryDirectory(prefix="lesson-") as root:
        plugin_dir, gophers = os.path.join(root, "device-plugins"), os.path.join(root, "gophers")
        os.mkdir(plugin_dir)
        async with trio.open_nursery() as nursery:
            kubelet = await nursery.start(KubeletSimulator(plugin_dir).run)
            say("kubelet", f"listening on {kubelet.socket_path}")

            async def until(what: str, check: Any) -> None:
                with trio.fail_after(10):
                    await kubelet.wait_until(lambda k: RESOURCE in k.resources and check(k.resources[RESOURCE]))
                devices = ", ".join(f"{d} {h}" for d, h in sorted(kubelet.resources[RESOURCE].devices.items()))
                say("kubelet", f"{what}: {devices or 'no devices'}")

            await nursery.start(serve, gophers, plugin_dir)  # no gophers/ yet: the plugin waits for it
            say("kubelet", f"GetDevicePluginOptions, during Register: {said(kubelet.resources[RESOURCE].options)}")
            await until("ListAndWatch", lambda r: r.updates)
            plug(root, "gopher0", "gopher1", "gopher2")
            say("demo", "plugged in: gophers/ appears with gopher0, gopher1, gopher2")
            await until("ListAndWatch", lambda r: len(r.devices) == 3)
            answer = (await kubelet.allocate(RESOURCE, ["gopher0", "gopher1"])).container_responses[0]
            say("kubelet", f"Allocate(gopher0, gopher1) -> env {dict(answer.envs)}")
            for spec in answer.devices:
                say("kubelet", f"  device {spec.host_path} -> {spec.container_path} ({spec.permissions})")
            open(os.path.join(gophers, "gopher3"), "x").close()
            say("demo", "created gophers/gopher3")
            await until("ListAndWatch (inotify told the plugin)", lambda r: "gopher3" in r.devices)
            os.symlink(os.path.join(gophers, ".missing"), os.path.join(gophers, "gopher4"))
            say("demo", "gophers/gopher4: a symlink to nothing")
            await until("ListAndWatch", lambda r: r.devices.get("gopher4") == "Unhealthy")
            open(os.path.join(gophers, ".missing"), "x").close()
            say("demo", "its target appeared")
            await until("ListAndWatch", lambda r: r.devices.get("gopher4") == "Healthy")
            shutil.rmtree(gophers)
            say("demo", "unplugged: gophers/ deleted, as udev deletes /dev/serial/by-id")
            await until("ListAndWatch", lambda r: not r.devices)
            plug(root, "gopher0")
            say("demo", "plugged in again: a new gophers/ with gopher0")
            await until("ListAndWatch (the new directory watched)", lambda r: list(r.devices) == ["gopher0"])
            registrations = len(kubelet.registrations)
            kubelet.restart()
            say("demo", "the kubelet restarts: it deletes every socket, makes a new kubelet.sock")
            await until(
                "ListAndWatch, after Register", lambda r: len(kubelet.registrations) > registrations and r.devices
            )
            nursery.cancel_scope.cancel()
        say("demo", "done: the plugin stopped, its socket removed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo", action="store_true", help="run against gopherplug's kubelet simulator")
    parser.add_argument("--directory", default="/dev/gophers", help="the devices: one per entry")
    parser.add_argument("--device-plugin-dir", default="/var/lib/kubelet/device-plugins")
    args = parser.parse_args()
    trio.run(demo) if args.demo else trio.run(serve, args.directory, args.device_plugin_dir)


if __name__ == "__main__":
    main()
