import logging

import trio

import gopherplug

# A resource whose devices your program knows; the same keys as a configuration file's resource.
resource = gopherplug.resource_config("example.com/widget", env="WIDGETS")
devices = gopherplug.Watched({})  # device ID -> DeviceEntry: set() it whenever your devices change


def shape(chosen: list[gopherplug.DeviceEntry], response: gopherplug.ContainerAllocateResponse) -> None:
    """Called for each container after gopherplug filled in its Allocate answer: add what you need."""
    response.envs["WIDGET_FIRMWARE"] = "2.1"
    for device in chosen:
        response.devices.add(host_path=device.path, container_path=f"/dev/{device.id}", permissions="rw")


async def main(device_plugin_dir: str | None = None) -> None:  # None: $GOPHERPLUG_DEVICE_PLUGIN_DIR, or kubelet.sock's
    devices.set({name: gopherplug.DeviceEntry(name, f"/dev/{name}") for name in ("w0", "w1")})
    async with trio.open_nursery() as nursery:
        await nursery.start(gopherplug.serve_devices, resource, devices, device_plugin_dir, shape)
        # ...your program goes on; devices.set(...) when widgets come, go or turn unhealthy.


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    trio.run(gopherplug.serve_until_signalled, main)  # SIGTERM, Ctrl-C: stops, its socket removed
