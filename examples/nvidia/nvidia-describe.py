#!/usr/bin/env python3
"""Describe a node's NVIDIA GPUs for gopherplug's `describe`: nvidia-smi's CSV in, JSON out.

    describe: ["python3.11", "/opt/gopherplug/nvidia-describe.py"]

gopherplug runs it once per scan of the resource and reads one JSON object keyed by device ID:

    {"0": {"attributes": {"index": 0, "productName": "NVIDIA H200", "uuid": "GPU-e2172bd0-...",
                          "driverVersion": {"version": "580.159.4"},
                          "computeCapability": {"version": "9.0.0"},
                          "resource.kubernetes.io/pciBusID": "0000:00:06.0",
                          "resource.kubernetes.io/pcieRoot": "pci0000:00"},
           "capacity": {"memory": "143771Mi"}}}

The device ID is the number of the GPU's node, /dev/nvidia<N> (the configs' id_pattern), which is
the node's minor number. nvidia-smi numbers GPUs its own way (`index`, NVML's order, by PCI
address), which is usually but not always the same: the driver gives minors in the order it
probed the GPUs. So each GPU is matched to its minor through its PCI address, in the driver's
/proc/driver/nvidia/gpus/<address>/information ("Bus Location", "Device Minor"); a GPU found in
only one of the two is left out, with a line on stderr. nvidia-smi's index is the attribute
`index`: NVIDIA's container toolkit reads the numbers in NVIDIA_VISIBLE_DEVICES as indices, so
where a GPU's index is not its ID, check-config and the slice show it.

Values are as the API server wants them in a ResourceSlice: versions as semantic versions (the
driver's "580.159.04" is 580.159.4, leading zeros are not semver; compute capability "9.0" is
9.0.0), memory as a quantity in Mi (nvidia-smi's MiB), the PCI address as sysfs and the standard
attribute spell it ("0000:00:06.0": nvidia-smi prints an 8-digit domain, upper-case hex). The
standard pcieRoot and numaNode attributes, which gopherplug reads from sysfs for other devices
through their node (/sys/dev/char/MAJ:MIN), come from the PCI function's own directory instead:
the nvidia driver registers no class device, so /sys/dev/char/195:0 does not exist, and the PCI
address nvidia-smi gives is the only way from a GPU to its place on the PCIe tree. A value
nvidia-smi does not know ("N/A", "[N/A]", "[Not Supported]", any "[...]") is left out, never
guessed. Python's standard library only: it runs in the plugin's image as it is.

Exit 0 with the JSON (possibly "{}"), or 1 with one line on stderr saying why (nvidia-smi missing,
failing, or the driver's /proc files absent): gopherplug then keeps the devices, without these
values, and logs that line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from typing import Any

#: What is asked of nvidia-smi, in this order.
FIELDS = ("index", "uuid", "name", "memory.total", "pci.bus_id", "driver_version", "compute_cap")
#: Less than gopherplug's 10 s for the whole describe: this process, not gopherplug, says it hung.
TIMEOUT = 8.0
#: The longest string attribute value a ResourceSlice may hold.
STRING_MAX = 64
#: An extended BDF as sysfs writes it (domain:bus:device.function) and the standard attribute
#: resource.kubernetes.io/pciBusID takes it.
PCI_ADDRESS = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")


def known(value: str) -> str | None:
    """The value, or None where nvidia-smi says it does not know it ("N/A", "[N/A]",
    "[Not Supported]", "[Unknown Error]", "[Insufficient Permissions]", ...)."""
    value = value.strip()
    if not value or value == "N/A" or (value.startswith("[") and value.endswith("]")):
        return None
    return value


def semver(value: str) -> str | None:
    """A dotted version of one to three numbers as a semantic version (580.159.04 -> 580.159.4,
    9.0 -> 9.0.0); None for anything else."""
    parts = value.split(".")
    if not 1 <= len(parts) <= 3 or not all(part.isdigit() and part.isascii() for part in parts):
        return None
    return ".".join(str(int(part)) for part in [*parts, "0", "0"][:3])


def pci_address(value: str) -> str | None:
    """nvidia-smi's "00000000:00:06.0" as sysfs's "0000:00:06.0"; None if it is not an address."""
    domain, colon, rest = value.lower().partition(":")
    if not colon or not re.fullmatch(r"[0-9a-f]{1,8}", domain):
        return None
    address = f"{int(domain, 16):04x}:{rest}"
    return address if PCI_ADDRESS.fullmatch(address) else None


def topology(sysfs: str, address: str) -> dict[str, Any]:
    """The standard pcieRoot and numaNode attributes of the PCI function at ``address``, as
    sysfs knows them: the root is the first directory under devices/ on the way to the function
    (devices/pci0000:00/0000:00:06.0), as Kubernetes' deviceattribute package reads it; the NUMA
    node its numa_node, left out when -1 (one node, or a VM that reports none)."""
    found: dict[str, Any] = {}
    function = os.path.join(sysfs, "bus", "pci", "devices", address)
    devices = os.path.realpath(os.path.join(sysfs, "devices"))
    here = os.path.realpath(function)
    if here.startswith(devices + os.sep) and os.path.basename(here) == address:
        root = os.path.relpath(here, devices).split(os.sep)[0]
        if root.startswith("pci"):
            found["resource.kubernetes.io/pcieRoot"] = root
    try:
        with open(os.path.join(function, "numa_node"), encoding="ascii") as file:
            numa_node = int(file.read())
    except (OSError, ValueError):
        numa_node = -1
    if numa_node >= 0:
        found["resource.kubernetes.io/numaNode"] = numa_node
    return found


def minors(proc: str) -> dict[str, str]:
    """PCI address -> minor number of its node, from the driver's information files."""
    gpus = os.path.join(proc, "gpus")
    found = {}
    for name in sorted(os.listdir(gpus)):  # FileNotFoundError: the caller says what it means
        try:
            with open(os.path.join(gpus, name, "information"), encoding="utf-8") as file:
                text = file.read()
        except OSError:
            continue
        fields = dict(line.partition(":")[::2] for line in text.splitlines())
        location, minor = (fields.get(key, "").strip() for key in ("Bus Location", "Device Minor"))
        if (address := pci_address(location)) and minor.isdigit():
            found[address] = minor
    return found


def describe(csv: str, by_address: dict[str, str], sysfs: str, warn: Any) -> dict[str, Any]:
    """The JSON object for nvidia-smi's `--format=csv,noheader,nounits` output of FIELDS."""
    devices: dict[str, Any] = {}
    for line in csv.splitlines():
        if not line.strip():
            continue
        values = line.split(", ")
        if len(values) < len(FIELDS):
            warn(f"left out a line of nvidia-smi's with {len(values)} fields, not {len(FIELDS)}: {line!r}")
            continue
        # A product name is the one field that might hold ", ": it is what is left in the middle.
        middle = len(values) - len(FIELDS) + 1
        index, uuid = values[:2]
        name = ", ".join(values[2 : 2 + middle])
        memory, bus_id, driver, capability = values[2 + middle :]
        address = pci_address(known(bus_id) or "")
        device_id = by_address.get(address or "")
        if device_id is None:
            warn(f"left out GPU {index.strip()} (PCI {bus_id.strip()}): the driver lists no node for it")
            continue
        if device_id != index.strip():
            # NVIDIA_VISIBLE_DEVICES=<N> means nvidia-smi's index N to NVIDIA's container runtime.
            warn(f"/dev/nvidia{device_id} is nvidia-smi's GPU {index.strip()}: indices and minors differ on this node")
        attributes: dict[str, Any] = {}
        if index.strip().isdigit() and index.strip().isascii():
            attributes["index"] = int(index)
        if (product := known(name)) and len(product) <= STRING_MAX:
            attributes["productName"] = product
        if (gpu_uuid := known(uuid)) and len(gpu_uuid) <= STRING_MAX:
            attributes["uuid"] = gpu_uuid
        if version := semver(known(driver) or ""):
            attributes["driverVersion"] = {"version": version}
        if version := semver(known(capability) or ""):
            attributes["computeCapability"] = {"version": version}
        if address:
            attributes["resource.kubernetes.io/pciBusID"] = address
            attributes.update(topology(sysfs, address))
        capacity = {}
        if (mebibytes := known(memory)) and mebibytes.isdigit() and mebibytes.isascii():
            capacity["memory"] = f"{int(mebibytes)}Mi"
        devices[device_id] = {"attributes": attributes, "capacity": capacity}
    return devices


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nvidia-smi", default="nvidia-smi", help="the program to run (default: from PATH)")
    parser.add_argument("--proc", default="/proc/driver/nvidia", help="the driver's /proc directory")
    parser.add_argument("--sysfs", default="/sys", help="the host's sysfs")
    args = parser.parse_args(argv)

    def warn(line: str) -> None:
        print(f"nvidia-describe: {line}", file=sys.stderr)

    try:
        by_address = minors(args.proc)
    except OSError as error:
        warn(f"{error.filename}: {error.strerror}: the nvidia driver is not loaded, or this is not the host's /proc")
        return 1
    command = [args.nvidia_smi, f"--query-gpu={','.join(FIELDS)}", "--format=csv,noheader,nounits"]
    try:
        ran = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT, check=False)
    except FileNotFoundError:
        warn(f"{args.nvidia_smi}: not found: this container needs nvidia-smi (and libnvidia-ml) from the driver")
        return 1
    except subprocess.TimeoutExpired:
        warn(f"{args.nvidia_smi} did not answer in {TIMEOUT:g} s")
        return 1
    if ran.returncode != 0:
        said = (ran.stdout + ran.stderr).strip().splitlines()  # nvidia-smi's errors go to stdout
        warn(f"{args.nvidia_smi} exited {ran.returncode}: {said[-1] if said else 'and said nothing'}")
        return 1
    json.dump(describe(ran.stdout, by_address, args.sysfs, warn), sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
