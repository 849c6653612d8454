"""A device plugin in one sitting: the "Gopher" tutorial's plugin, done right.

Every entry of a directory is one device of the resource example.com/gopher. The plugin serves the
kubelet's DevicePlugin API (v1beta1) on a unix socket, registers through kubelet.sock, streams the
device list as entries come and go (inotify), answers Allocate, judges health by opening the entry,
and registers again whenever the kubelet restarts. Read it top to bottom:

  1. Devices        a directory -> {ID: health}; inotify keeps it current
  2. The service    GetDevicePluginOptions, ListAndWatch, Allocate: one method each
  3. The kubelet    serve a socket, Register, and again after each kubelet restart
  4. The demo       `python gopher_plugin.py --demo`: gopherplug's kubelet simulator, narrated

gopherplug gives it the v1beta1 messages and the gRPC-over-unix-socket glue (serve_grpc,
call_unary, Watched); the protocol is all here. gopherplug.py is the same, grown up: docs/protocol.md.
"""

from __future__ import annotations

import argparse
import itertools
import os
import tempfile
import time
from collections.abc import AsyncIterator
from typing import Any

import trio
from inotify_simple import INotify, flags

from gopherplug import METHODS, KubeletSimulator, RPCError, StatusCode, Watched, call_unary, serve_grpc, v1beta1

# The contract (k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1): its version, the kubelet's socket.
API_VERSION, KUBELET_SOCKET = "v1beta1", "kubelet.sock"
RESOURCE = "example.com/gopher"
START = time.monotonic()


def say(who: str, what: str) -> None:
    print(f"{(time.monotonic() - START) * 1e3:8.1f} ms  {who:<8} {what}", flush=True)


# 1. Devices. A device's ID is its entry's name; the kubelet only ever sees IDs and health.


def health(path: str) -> str:
    # Healthy: a container given this entry could use it, so open it as the container would. A
    # symlink to nothing or a mode we may not use is Unhealthy, Healthy again once fixed (the
    # tutorial's are Healthy forever). gopherplug asks access() instead: some devices act when
    # opened (a serial port raises DTR).
    try:
        os.close(os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_NOCTTY))
    except OSError:
        return "Unhealthy"
    return "Healthy"


def scan(directory: str) -> dict[str, str]:
    """The devices now: ID -> health. Hidden entries are not devices."""
    try:
        names = sorted(name for name in os.listdir(directory) if not name.startswith("."))
    except FileNotFoundError:
        return {}
    return {name: health(os.path.join(directory, name)) for name in names}


async def read_events(inotify: INotify) -> list[Any]:
    """The next batch of inotify events, waited for without a thread or polling."""
    await trio.lowlevel.wait_readable(inotify.fileno())
    return list(inotify.read(timeout=0))


async def watch_devices(directory: str, devices: Watched) -> None:
    # inotify, not a rescan every few seconds: the kubelet hears of a new device in milliseconds.
    # ATTRIB is a chmod: health can change without the entry changing. Any event means "rescan":
    # one read of a directory is cheap, and a batch of events becomes one new list.
    with INotify() as inotify:
        inotify.add_watch(directory, flags.CREATE | flags.DELETE | flags.MOVED_FROM | flags.MOVED_TO | flags.ATTRIB)
        while True:
            await read_events(inotify)
            devices.set(scan(directory))  # wakes every ListAndWatch stream, if anything changed


# 2. The service. The kubelet calls these on our socket; each method is one RPC of v1beta1.


class GopherPlugin:
    def __init__(self, directory: str, devices: Watched) -> None:
        self.directory, self.devices = directory, devices

    async def GetDevicePluginOptions(self, empty: Any) -> Any:  # noqa: N802 - the RPC's name
        # The kubelet calls this while handling our Register, before it answers: our socket must
        # already be serving. We ask for neither PreStartContainer nor GetPreferredAllocation, so
        # the kubelet never calls them.
        return v1beta1.DevicePluginOptions()

    async def ListAndWatch(self, empty: Any) -> AsyncIterator[Any]:  # noqa: N802
        # The kubelet opens one stream right after Register and keeps it open for as long as the
        # registration lives. Each message is the WHOLE list: it replaces the one before. If the
        # stream ends, the kubelet marks every device unhealthy at once, so it must not end.
        current = self.devices.value
        while True:
            yield v1beta1.ListAndWatchResponse(
                devices=[v1beta1.Device(ID=id_, health=health_) for id_, health_ in current.items()]
            )
            current = await self.devices.wait_changed(current)

    async def Allocate(self, request: Any) -> Any:  # noqa: N802
        # Once per container the kubelet admits, with the IDs it chose from our healthy ones. What
        # we answer is what the runtime gives the container: device nodes (DeviceSpecs), env, mounts.
        # Look again, not at our last list: the entry may have gone or turned unhealthy since.
        answers = []
        for container in request.container_requests:
            answer = v1beta1.ContainerAllocateResponse()
            for device_id in container.devices_ids:
                path = os.path.join(self.directory, device_id)
                if device_id not in self.devices.value or not os.path.lexists(path):
                    raise RPCError(StatusCode.INVALID_ARGUMENT, f"unknown device {device_id}")
                if health(path) != "Healthy":  # the pod fails to start, with this line in its events
                    raise RPCError(StatusCode.FAILED_PRECONDITION, f"device {device_id} is unhealthy")
                # host_path is opened by the runtime on the host: the symlink's target, not the link.
                target = os.path.realpath(path)
                answer.devices.add(host_path=target, container_path=f"/dev/{device_id}", permissions="rw")
            answer.envs["GOPHER_DEVICES"] = ",".join(container.devices_ids)
            answers.append(answer)
        return v1beta1.AllocateResponse(container_responses=answers)

    def service(self) -> Any:
        import purerpc  # after gopherplug, whose glue lets purerpc 0.8 run on h2 4

        service = purerpc.Service(f"{API_VERSION}.DevicePlugin")
        for name in ("GetDevicePluginOptions", "ListAndWatch", "Allocate"):
            service.add_method(name, getattr(self, name), METHODS[f"/{API_VERSION}.DevicePlugin/{name}"].signature)
        return service


# 3. The kubelet. It owns its directory: at every start it deletes every socket in it (ours too)
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


async def serve(directory: str, plugin_dir: str, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    devices = Watched(scan(directory))
    kubelet_socket = os.path.join(plugin_dir, KUBELET_SOCKET)
    with INotify() as kubelet:
        kubelet.add_watch(plugin_dir, flags.CREATE | flags.DELETE)  # before anything can happen there
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_devices, directory, devices)
            for generation in itertools.count(1):
                while (registered_with := inode(kubelet_socket)) is None:  # no kubelet yet: wait for one
                    await read_events(kubelet)
                endpoint = f"gopher-{generation}.sock"  # a new name each time: never the old socket's
                async with trio.open_nursery() as server:
                    # Serve first, then Register: the kubelet dials us back before it answers.
                    service = GopherPlugin(directory, devices).service()
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


# 4. The demo: gopherplug's kubelet simulator, as strict as the kubelet, and this plugin.


async def demo() -> None:
    with tempfile.TemporaryDirectory(prefix="lesson-") as root:
        plugin_dir, gophers = os.path.join(root, "device-plugins"), os.path.join(root, "gophers")
        os.mkdir(plugin_dir)
        os.mkdir(gophers)
        for name in ("gopher0", "gopher1", "gopher2"):
            open(os.path.join(gophers, name), "x").close()
        async with trio.open_nursery() as nursery:
            kubelet = await nursery.start(KubeletSimulator(plugin_dir).run)
            say("kubelet", f"listening on {kubelet.socket_path}")

            async def until(what: str, check: Any) -> None:
                with trio.fail_after(10):
                    await kubelet.wait_until(lambda k: RESOURCE in k.resources and check(k.resources[RESOURCE]))
                devices = kubelet.resources[RESOURCE].devices
                say("kubelet", f"{what}: {', '.join(f'{d} {h}' for d, h in sorted(devices.items()))}")

            await nursery.start(serve, gophers, plugin_dir)
            await until("first list", lambda r: len(r.devices) == 3)
            answer = (await kubelet.allocate(RESOURCE, ["gopher0", "gopher1"])).container_responses[0]
            say("kubelet", f"Allocate(gopher0, gopher1) -> env {dict(answer.envs)}")
            for spec in answer.devices:
                say("kubelet", f"  device {spec.host_path} -> {spec.container_path} ({spec.permissions})")
            open(os.path.join(gophers, "gopher3"), "x").close()
            say("demo", "created gophers/gopher3")
            await until("inotify told the plugin, the plugin told the kubelet", lambda r: "gopher3" in r.devices)
            os.symlink(os.path.join(gophers, ".missing"), os.path.join(gophers, "gopher4"))
            say("demo", "gophers/gopher4: a symlink to nothing")
            await until("listed unhealthy", lambda r: r.devices.get("gopher4") == "Unhealthy")
            open(os.path.join(gophers, ".missing"), "x").close()
            say("demo", "its target appeared")
            await until("healthy again", lambda r: r.devices.get("gopher4") == "Healthy")
            registrations = len(kubelet.registrations)
            kubelet.restart()
            say("demo", "the kubelet restarts: it deletes every socket, makes a new kubelet.sock")
            await until("registered again", lambda r: len(kubelet.registrations) > registrations and r.devices)
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
