"""A DRA driver for devices your program finds itself: widgets, here, whose nodes are /dev/widget*.

gopherplug.serve_dra_devices publishes them as ResourceSlices of this node's pool and answers the
kubelet's NodePrepareResources with CDI devices; this program only says which widgets there are
and whether each is healthy, by setting a Watched whenever that changes.

In a DaemonSet pod (in-cluster credentials, NODE_NAME from spec.nodeName, the kubelet's
/var/lib/kubelet and /var/run/cdi mounted from the host, as daemonset-dra.yaml does):

    python3 dra_driver.py

Outside a pod (KUBECONFIG's credentials), or against stand-ins, name what differs:

    NODE_NAME=node-1 KUBECONFIG=~/.kube/config python3 dra_driver.py \
        --kubelet-dir /tmp/kubelet --cdi-dir /tmp/cdi --dev-dir /tmp/dev

SIGTERM or Ctrl-C stops it: its sockets go, its slices stay for the next pod of the driver (the
kubelet deletes them if none comes back).
"""

import argparse
import functools
import logging
import os
import signal
import sys

import trio

import gopherplug

#: How often the widgets are looked for again (a real driver might wait for udev events instead).
LOOK_EVERY = 2.0


def find_widgets(dev_dir: str) -> dict[str, gopherplug.DeviceEntry]:
    """The widgets now: device ID -> DeviceEntry, with the node a container gets. A widget whose
    node is not readable and writable is unhealthy: the scheduler keeps new claims off it (its
    slice's taint) and the kubelet shows it in the pod's status (the health stream)."""
    widgets = {}
    for name in sorted(os.listdir(dev_dir)):
        if not name.startswith("widget"):
            continue
        path = os.path.join(dev_dir, name)
        usable = os.access(path, os.R_OK | os.W_OK)
        widgets[name] = gopherplug.DeviceEntry(
            name,
            path,
            # The node, under /dev in the container; the CDI spec describes it once per device.
            device_specs=(gopherplug.DeviceSpecTemplate(host_path=path, container_path=f"/dev/{name}"),),
            health=gopherplug.HEALTHY if usable else gopherplug.UNHEALTHY,
            problem="" if usable else "not-accessible",  # a label value: the taint's value shows it
        )
    return widgets


async def main(args: argparse.Namespace) -> None:
    # Every option of a configuration file's resource that DRA has: its name and env var (each
    # container gets WIDGETS_<ID>=<id>).
    resource = gopherplug.resource_config("example.com/widget", env="WIDGETS")
    devices = gopherplug.Watched(find_widgets(args.dev_dir))
    async with trio.open_nursery() as nursery:
        # Raises ConfigError, one line, for an argument that cannot be right (a driver name that is no
        # DNS subdomain, no node name); otherwise returns once the kubelet can find the driver.
        serve = functools.partial(
            gopherplug.serve_dra_devices,
            resource,
            devices,
            driver=args.driver,
            node_name=args.node_name,  # None: NODE_NAME
            kubeconfig=args.kubeconfig,  # None: the pod's service account, else KUBECONFIG
            kubelet_dir=args.kubelet_dir,
            cdi_dir=args.cdi_dir,
            pod_uid=os.environ.get("POD_UID", ""),  # for a rolling update with two pods at once
        )
        await nursery.start(serve)
        print(f"serving {args.driver} for {resource.name}", file=sys.stderr, flush=True)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            nursery.start_soon(look_for_widgets, devices, args.dev_dir)
            async for _ in signals:
                nursery.cancel_scope.cancel()  # serve_dra_devices stops part by part, its sockets removed
                return


async def look_for_widgets(devices: gopherplug.Watched, dev_dir: str) -> None:
    while True:
        await trio.sleep(LOOK_EVERY)
        devices.set(find_widgets(dev_dir))  # a change only: set() wakes gopherplug when they differ


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--driver", default="widget.example.com", help="the DRA driver's name")
    parser.add_argument("--node-name", default=None, help="this node's name (default: $NODE_NAME)")
    parser.add_argument("--kubeconfig", default=None, help="default: in-cluster credentials, else $KUBECONFIG")
    parser.add_argument("--kubelet-dir", default="/var/lib/kubelet", help="the kubelet's root directory")
    parser.add_argument("--cdi-dir", default="/var/run/cdi", help="where the container runtime reads CDI specs")
    parser.add_argument("--dev-dir", default="/dev", help="where the widgets' nodes are")
    return parser.parse_args()


if __name__ == "__main__":
    args = arguments()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        trio.run(main, args)
    except* gopherplug.GopherplugError as group:  # nurseries wrap what they raise in groups
        error: BaseException = group
        while isinstance(error, BaseExceptionGroup):
            error = error.exceptions[0]
        sys.exit(f"dra_driver.py: {error}")  # one line: what to fix
