"""The runtime tier: gopherplug's shipped DaemonSets run in a real containerd, driven through the CRI as
the kubelet drives it.

    sudo GOPHERPLUG_RUNTIME=DIR .venv/bin/python -m pytest test_runtime.py

DIR holds containerd >= 1.7 (CDI-capable) with containerd-shim-runc-v2 and ctr, runc, a static busybox and
the CRI API (cri-api.proto), and DIR/containerd-2 a containerd 2.x with its shim and ctr (CI's matrix
has both; by hand it may be left out); every test runs under each containerd. Without root or without
DIR (default /opt/gopherplug-runtime) the whole module is skipped with one line saying so (a failure
instead when GOPHERPLUG_RUNTIME_REQUIRED is set, as CI does). Every binary comes from DIR, never from
PATH. GOPHERPLUG_TIER_RESULTS=FILE also writes the figures and the consumers' outputs, printed at the
end of the run, to FILE as JSON.

The cgroup mode is the one this process sees at /sys/fs/cgroup (cgroup2 there: v2), as runc's and
containerd's is; GOPHERPLUG_TIER_CGROUP=v1 or v2 says which one the run is meant for (V2_HOW: v2 on a
machine that boots v1).

Rules of the tier (this file and its machinery, runtimesupport.py):
- Nothing of the machine is touched but what the run creates: containerd has a private root, state,
  socket and CDI directory; the device nodes the tests make live in a directory of /dev unique to the run;
  the pod cgroups under a parent unique to the run. Everything is removed at the end, also on failure,
  containerd and every container by PID.
- The pods are the manifests' own (daemonset.yaml, daemonset-dra.yaml, read as shipped: the Helm
  chart's renders, which test_chart.py keeps equal to `helm template`). The translation to CRI
  requests copies what the kubelet does (sources cited beside each piece); the only substitutions
  are the image, the host side of hostPath volumes (private directories; /dev and /sys stay the host's),
  the ConfigMap's contents, the API server's address and the service account's token, and the host's
  network namespace for the sandboxes (no CNI here), which makes each pod's liveness port one of its
  own (the ConfigMap's health_address and the port the probe names, together).
- Assertions rest on what containerd or the container itself reports (ExecSync, ContainerStatus), and on
  what the kubelet stand-ins received, never on gopherplug's word.
- Every I/O has a bound; nothing sleeps to synchronise. Where no event exists (containerd's socket
  answering, a container's state), a short bounded poll of the real thing stands in.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import socket
import ssl
import stat
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import trio
import yaml

import gopherplug as gp
import gopherplug_standins as standins

# The tier's machinery: importing it skips this module (or fails it) where the tier cannot run.
import runtimesupport as rs
from runtimesupport import (
    BUSYBOX_IMAGE,
    CGROUP_V2,
    CONTAINERDS,
    DEVICE_MAJOR,
    DEVICE_MINOR,
    DOCKERFILE_IMAGES,
    DP_CDI_CASE,
    DRIVER,
    DROPPED_RESOURCES,
    HERE,
    HOST_GID,
    HOST_UID,
    NODE_NAME,
    RESOURCE,
    RESULTS,
    TIMEOUT,
    Containerd,
    Node,
    Pod,
    Run,
    RuncWithoutLimits,
    allocated_fields,
    allocated_mounts,
    build_images,
    compile_cri,
    consumer_config,
    consumer_report,
    container_cgroup,
    container_status,
    containerd_version,
    device_rules,
    exec_sync,
    image_of,
    kubelet_lists,
    liveness_probe,
    manifest_config,
    manifest_docs,
    manifest_pod,
    ms_since,
    not_granted_refused,
    quantity,
    remove_cgroups,
    report,
    running_pod,
)


@pytest.fixture(scope="session")
def images(pytestconfig):
    """The CRI compiled and the images' archives built, once for every containerd of the run."""
    root = Path(tempfile.mkdtemp(prefix=f"gpimg-{secrets.token_hex(3)}-", dir="/tmp"))
    try:
        rs.PB, rs.CRI = compile_cri(root)
        built = time.monotonic()
        archives = build_images(root)
        RESULTS["image build (s)"] = round(time.monotonic() - built, 1)
        RESULTS["plugin images"] = (
            f"the Dockerfile's (GOPHERPLUG_TIER_IMAGES={DOCKERFILE_IMAGES})"
            if DOCKERFILE_IMAGES is not None
            else "made by the tier (the host's python3.11 and the project)"
        )
        # A docker archive holds its layers uncompressed: about the image's size on a node.
        RESULTS["image sizes (MB, archive)"] = {k: round(v.stat().st_size / 1e6, 1) for k, v in archives.items()}
        yield archives
    finally:
        shutil.rmtree(root, ignore_errors=True)
        report(pytestconfig, "runtime tier", {k: v for k, v in RESULTS.items() if k not in CONTAINERDS})


@pytest.fixture(scope="session", params=sorted(CONTAINERDS))
def tier(request, images, pytestconfig):
    """The run under one containerd of CONTAINERDS (every test runs under each): containerd started
    and the images imported; at the end, whatever happened, containerd and its containers stopped by
    PID, mounts, cgroups, the run's /dev directory and files removed, and the figures and consumers'
    outputs printed."""
    root = Path(tempfile.mkdtemp(prefix=f"gprt-{secrets.token_hex(3)}-", dir="/tmp"))
    tier = Run(root, request.param, images)
    try:
        tier.dev.mkdir(mode=0o755)
        if DROPPED_RESOURCES:
            tier.runc = RuncWithoutLimits(root)
        tier.containerd = tier.containerd_for(root / "ctrd")
        # The device-plugin resource with `cdi:` writes its spec where its pod can write (see
        # test_a_device_plugin_cdi_device_reaches_a_consumer); the runtime reads that directory too.
        tier.containerd.extra_cdi_dirs.append(root / "host" / DP_CDI_CASE / "kubelet" / "device-plugins" / "cdi")
        tier.containerd.extra_cdi_dirs[-1].mkdir(parents=True)
        tier.containerd.start()
        imported = time.monotonic()
        for archive in tier.archives.values():
            tier.containerd.import_image(archive)
        tier.figures["image import (s)"] = round(time.monotonic() - imported, 1)
        yield tier
    finally:
        for containerd in (tier.containerd, tier.second):
            if containerd is not None:
                try:
                    containerd.stop()
                except Exception as error:  # the rest of the cleanup must still happen
                    print(f"stopping the containerd in {containerd.root}: {error!r}")
        remove_cgroups(tier.cgroup_parent)
        shutil.rmtree(tier.dev, ignore_errors=True)
        for link in tier.links:
            link.unlink(missing_ok=True)
        shutil.rmtree(root, ignore_errors=True)
        tier.figures["tier duration (s)"] = round(time.monotonic() - tier.started, 1)
        version = containerd_version(CONTAINERDS[tier.name])
        RESULTS[tier.name] = {
            "containerd": f"{version[0]}.{version[1]}",
            "cgroup": RESULTS["cgroup"],
            "figures": tier.figures,
            "consumer outputs": tier.outputs,
        }
        report(pytestconfig, f"runtime tier results ({tier.name}, cgroup {RESULTS['cgroup']})", RESULTS[tier.name])


########################################################################################################
# The device plugin, as daemonset.yaml ships it


async def test_device_plugin_pod_registers_and_offers_a_mknod_node_healthy(tier, nursery):
    """The shipped pod starts under the shipped security context (read-only root, no capability,
    seccomp, no_new_privs, the memory limit: the container shows each), registers, and offers device
    nodes its own device cgroup forbids it to open (10:229 is not in the runtime's default allowlist)
    as Healthy; a node its mode refuses to it as Unhealthy."""
    node = Node(tier, "daemonset.yaml")
    node.mknod("gopher0")
    kubelet = await nursery.start(gp.KubeletSimulator(str(node.device_plugin_dir)).run)
    with trio.fail_after(TIMEOUT):
        async with node.running() as plugin:
            started = time.monotonic()
            await kubelet.wait_until(lambda k: kubelet_lists(k, "gopher0"))
            tier.figures["device plugin: container started -> registered, first list (ms)"] = ms_since(started)
            code, said = await exec_sync(
                tier.containerd, plugin, "python3.11", "-c", SHOW_CONFINEMENT, str(node.devices / "gopher0")
            )
            assert code == 0, said
            confinement = json.loads(said)
            tier.outputs["device plugin: the plugin's confinement, from inside"] = confinement
            assert confinement["CapEff"] == "0000000000000000" and confinement["NoNewPrivs"] == "1"
            assert confinement["Seccomp"] == "2"  # filter mode: RuntimeDefault
            assert confinement["write /"].startswith("OSError: [Errno 30] Read-only file system")
            # The cgroup, read on the host: in the pod, /sys is the host's own (the manifest's mount).
            limit = quantity(manifest_pod("daemonset.yaml")["spec"]["containers"][0]["resources"]["limits"]["memory"])
            if "memory" in DROPPED_RESOURCES:
                # Cannot hold here: this machine's cgroup v2 hierarchy has no memory controller, so
                # RuncWithoutLimits took the limit out of the spec before runc (which would fail on
                # it) and nothing enforces it. What holds: the spec containerd handed runc had it.
                assert tier.runc is not None and tier.runc.dropped(plugin)["memory"]["limit"] == limit
                enforced = "not enforced: this cgroup v2 hierarchy has no memory controller (dropped before runc)"
            else:
                assert await memory_limit(tier.containerd, plugin) == limit
                enforced = "memory.max" if CGROUP_V2 else "memory.limit_in_bytes"
            tier.outputs["device plugin: memory limit"] = f"{limit} in the spec given to runc; {enforced}"
            # The plugin's own cgroup refuses the node: what makes the health question real.
            assert confinement["open gopher0"] == "PermissionError: [Errno 1] Operation not permitted", confinement
            listed = []
            for number in range(1, 21):
                # Not synchronisation: spacing the samples beyond gopherplug's push interval, so each
                # one measures a lone change, not the interval left from the previous one.
                await trio.sleep(2 * gp.LIST_PUSH_INTERVAL)
                created = time.monotonic()
                node.mknod(f"gopher{number}")
                await kubelet.wait_until(lambda k, n=number: kubelet_lists(k, f"gopher{n}"))
                listed.append(ms_since(created))
            tier.figures["device plugin: mknod -> kubelet stand-in lists it (ms, n=20)"] = _spread(listed)
            # A node whose mode refuses root without capabilities (EACCES, before the device cgroup is
            # asked) is one the plugin, and any consumer running as it does, cannot use: Unhealthy.
            locked = node.mknod("locked")
            locked.chmod(0)
            await kubelet.wait_until(lambda k: kubelet_lists(k, "locked"))
            devices = kubelet.resources[RESOURCE].devices
            assert devices == {**{f"gopher{n}": gp.HEALTHY for n in range(21)}, "locked": gp.UNHEALTHY}
            # gopherplug's health check is access(): what the kernel says to it in the plugin's
            # container, in either cgroup mode (v1: devices.list; v2: the eBPF program), beside the
            # verdicts the kubelet got and the plugin's own device rules (no 10:229 among them).
            code, said = await exec_sync(
                tier.containerd, plugin, "python3.11", "-c", SHOW_ACCESS, str(node.devices / "gopher0"), str(locked)
            )
            assert code == 0, said
            errnos = json.loads(said)
            own_rules = await device_rules(tier.containerd, plugin)
            tier.outputs["device plugin: access() in the plugin's container -> the kubelet's verdict"] = {
                name: f"{errnos[str(node.devices / name)]} -> {devices[name]}" for name in ("gopher0", "locked")
            }
            tier.outputs["device plugin: the plugin's own device rules (host side)"] = {
                **{k: v for k, v in own_rules.items() if k == "program"},
                "rules": [rule for rule in own_rules["rules"] if rule.startswith(f"c {DEVICE_MAJOR}:")],
            }
            assert errnos == {str(node.devices / "gopher0"): "EPERM", str(locked): "EACCES"}, errnos
            assert f"c {DEVICE_MAJOR}:{DEVICE_MINOR} rw" not in own_rules["rules"]
            tier.figures["device plugin: idle RSS, 21 devices (MiB)"] = await _rss(tier.containerd, plugin)


#: The plugin's metrics page, fetched over loopback from inside its container.
SCRAPE = """
import sys, urllib.request
with urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics", timeout=10) as answer:
    sys.stdout.write(answer.read().decode())
"""

#: Run by the plugin's own Python in its container: access(R_OK | W_OK) of each path, as gopherplug's
#: health check asks it (0, or the errno's name).
SHOW_ACCESS = """
import ctypes, errno, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
said = {}
for path in sys.argv[1:]:
    said[path] = "0" if libc.access(path.encode(), os.R_OK | os.W_OK) == 0 else errno.errorcode[ctypes.get_errno()]
print(json.dumps(said))
"""

#: Run by the plugin's own Python in its container: what confines it, as the kernel reports it.
SHOW_CONFINEMENT = """
import json, os, sys
seen = {}
for line in open("/proc/self/status"):
    key, _, value = line.partition(":")
    if key in ("CapEff", "CapBnd", "NoNewPrivs", "Seccomp", "Uid"):
        seen[key] = value.strip()
for what, action in (("write /", lambda: open("/tier-probe", "w")),
                     ("open gopher0", lambda: open(sys.argv[1], "rb"))):
    try:
        action()
        seen[what] = "ok"
    except OSError as error:
        seen[what] = f"{type(error).__name__}: {error}".split(": '")[0]
print(json.dumps(seen))
"""


def _spread(samples: list[float]) -> str:
    ordered = sorted(samples)
    return f"p50 {ordered[len(ordered) // 2]}, max {ordered[-1]}"


async def cgroup_file(containerd: Containerd, container_id: str, controller: str, name: str) -> str:
    """A file of the container's cgroup, found through the runtime spec containerd reports (with the
    cgroupfs driver, cgroupsPath is a path under each hierarchy)."""
    path = await container_cgroup(containerd, container_id)
    hierarchy = Path("/sys/fs/cgroup") if CGROUP_V2 else Path("/sys/fs/cgroup") / controller
    return (hierarchy / path / name).read_text().strip()


async def memory_limit(containerd: Containerd, container_id: str) -> int:
    if CGROUP_V2:
        return int(await cgroup_file(containerd, container_id, "memory", "memory.max"))
    return int(await cgroup_file(containerd, container_id, "memory", "memory.limit_in_bytes"))


async def _rss(containerd: Containerd, container_id: str) -> dict[str, float]:
    """The plugin's resident memory: its process's VmRSS (the container's init, whose PID the verbose
    ContainerStatus gives) and its cgroup's anonymous memory (memory.stat: v1 total_rss, v2 anon)."""
    status = await container_status(containerd, container_id, verbose=True)
    info = json.loads(status.info["info"])
    found = re.search(r"VmRSS:\s+(\d+) kB", Path(f"/proc/{info['pid']}/status").read_text())
    assert found is not None
    figures = {"VmRSS": round(int(found[1]) / 1024, 1)}
    with contextlib.suppress(OSError, KeyError):
        stats = dict(
            line.split() for line in (await cgroup_file(containerd, container_id, "memory", "memory.stat")).splitlines()
        )
        figures["cgroup rss"] = round(int(stats["anon" if CGROUP_V2 else "total_rss"]) / 2**20, 1)
    return figures


async def test_the_distroless_recipe_serves_under_the_shipped_pod(tier, nursery):
    """examples/distroless/Dockerfile's image (docs/deployment.md, "A distroless image of your own")
    in daemonset.yaml's pod, its image swapped and nothing else: it starts under the shipped security
    context (read-only root, no capability), registers, and lists a device node Healthy."""
    if "distroless" not in tier.archives:
        pytest.skip("the distroless recipe's image is built by .ci/images: GOPHERPLUG_TIER_IMAGES")
    node = Node(tier, "daemonset.yaml")
    node.template["spec"]["containers"][0]["image"] = image_of(node.template) + "-distroless"
    node.mknod("gopher0")
    kubelet = await nursery.start(gp.KubeletSimulator(str(node.device_plugin_dir)).run)
    with trio.fail_after(TIMEOUT):
        async with node.running() as plugin:
            started = time.monotonic()
            await kubelet.wait_until(lambda k: kubelet_lists(k, "gopher0"))
            tier.figures["distroless recipe: container started -> registered, first list (ms)"] = ms_since(started)
            assert kubelet.resources[RESOURCE].devices == {"gopher0": gp.HEALTHY}
            code, said = await exec_sync(
                tier.containerd, plugin, "python3.11", "-c", SHOW_CONFINEMENT, str(node.devices / "gopher0")
            )
            assert code == 0, said
            confinement = json.loads(said)
            assert confinement["CapEff"] == "0000000000000000", confinement
            assert confinement["write /"].startswith("OSError: [Errno 30] Read-only file system"), confinement
            tier.figures["distroless recipe: idle RSS, 1 device (MiB)"] = await _rss(tier.containerd, plugin)


async def test_a_consumer_given_the_allocate_answer_opens_the_node_and_one_without_cannot(tier, nursery):
    """The consumer is created with what the kubelet stand-in's Allocate got (DeviceSpecs, env, mounts,
    annotations, CDI devices): the runtime puts the node in its /dev and its device cgroup, and it opens
    it read-write. A control container that sees the same node through a bind mount but got no
    DeviceSpec is refused by its device cgroup."""
    node = Node(tier, "daemonset.yaml")
    path = node.mknod("gopher0")
    kubelet = await nursery.start(gp.KubeletSimulator(str(node.device_plugin_dir)).run)
    with trio.fail_after(TIMEOUT):
        async with node.running() as plugin:
            await kubelet.wait_until(lambda k: kubelet_lists(k, "gopher0"))
            # The manifest's liveness probe, as the kubelet makes it: an HTTP GET from the host.
            code, said = await liveness_probe(node)
            assert code == 200, said
            tier.outputs["device plugin: liveness probe"] = f"{code} {said.strip()}"
            # And the operator's full check, `gopherplug probe`, in the plugin's container.
            code, said = await exec_sync(tier.containerd, plugin, "gopherplug", "probe", timeout=10)
            assert code == 0, said
            tier.outputs["device plugin: gopherplug probe"] = said.strip().splitlines()
            pod = Pod(tier, "consumer")
            holder = (pod.namespace, pod.name, "consumer")
            answer = (await kubelet.allocate(RESOURCE, ["gopher0"], container=holder)).container_responses[0]
            # The metrics the manifest turns on, scraped from inside the plugin's container as a
            # Prometheus in the pod network would (here the sandbox has the host's network).
            port = manifest_config("daemonset.yaml")["metrics_address"].rpartition(":")[2]
            code, page = await exec_sync(tier.containerd, plugin, "python3.11", "-c", SCRAPE, port)
            assert code == 0, page
            metrics = [line for line in page.splitlines() if line.startswith("gopherplug_")]
            tier.outputs["device plugin: metrics"] = metrics[:15]
            assert f'gopherplug_devices{{health="Healthy",resource="{RESOURCE}"}} 1.0' in metrics, page
            assert f'gopherplug_allocate_seconds_count{{resource="{RESOURCE}"}} 1.0' in metrics, page
            fields = allocated_fields(answer)
            assert [d.host_path for d in fields["devices"]] == [str(path)]
            config = consumer_config(pod, **fields)
            config.mounts.extend(allocated_mounts(answer))
            async with running_pod(tier.containerd, pod, pod.sandbox_config(), [config]):
                seen = await consumer_report(tier.containerd, pod.container_ids["consumer"], str(path))
                # Who holds it, as an operator asks: `gopherplug who` in the plugin's container,
                # through the manifest's read-only mount of the kubelet's PodResources socket.
                socket_path = str(node.kubelet_dir / gp.POD_RESOURCES_SOCKET)
                await nursery.start(standins.PodResourcesSimulator(socket_path, kubelet).run)
                code, who = await exec_sync(tier.containerd, plugin, "gopherplug", "who")
                assert code == 0, who
            control = Pod(tier, "control")
            config = consumer_config(control)
            config.mounts.append(
                rs.PB.Mount(container_path="/mnt/devices", host_path=str(node.devices), readonly=False)
            )
            async with running_pod(tier.containerd, control, control.sandbox_config(), [config]):
                refused = await consumer_report(
                    tier.containerd, control.container_ids["consumer"], "/mnt/devices/gopher0"
                )
    tier.outputs["device plugin: consumer"] = seen
    tier.outputs["device plugin: gopherplug who, while the consumer runs"] = who.strip().splitlines()
    assert who.strip() == f"{RESOURCE} gopher0 {path}: Healthy: {pod.namespace}/{pod.name}/consumer (device plugin)"
    tier.outputs["device plugin: control without the DeviceSpec"] = refused
    assert "GOPHER_DEVICES=gopher0" in seen["env"]
    assert seen["ls exit"] == 0 and seen["ls -l"].startswith("crw") and " 10, 229 " in seen["ls -l"]
    assert (seen["open exit"], seen["open rw"]) == (0, "opened rw")
    assert refused["ls exit"] == 0 and refused["ls -l"].startswith("crw")
    assert refused["open exit"] != 0 and "Operation not permitted" in refused["open rw"]
    assert not_granted_refused(seen) and not_granted_refused(refused)
    # The DeviceSpec's rule, in the consumer's device rules only (v1: devices.list; v2: its eBPF program).
    rule = f"c {DEVICE_MAJOR}:{DEVICE_MINOR} rw"
    assert rule in seen["device rules (host side)"] and rule not in refused["device rules (host side)"]


def _without_termination_message_path(template: dict[str, Any]) -> dict[str, Any]:
    template = json.loads(json.dumps(template))
    del template["spec"]["containers"][0]["terminationMessagePath"]
    return template


@pytest.mark.parametrize("manifest", ["daemonset.yaml", "daemonset-dra.yaml"])
async def test_the_default_termination_message_path_cannot_start_under_the_read_only_dev(tier, manifest):
    """Why the manifests set terminationMessagePath: with the default /dev/termination-log, runc must
    create the kubelet's bind-mount target in the host's /dev, mounted read-only, and the container
    never starts. The same pod with the shipped path is shown starting by the tests above and below."""
    node = Node(tier, manifest)
    node.template = _without_termination_message_path(node.template)
    with trio.fail_after(TIMEOUT), pytest.raises(rs.grpc.RpcError) as failed:
        async with node.running():
            pass
    message = failed.value.details()
    tier.outputs[f"{manifest} with /dev/termination-log"] = message
    assert '"/dev/termination-log"' in message and "read-only file system" in message


@contextlib.contextmanager
def _removed_afterwards(cdi_dir: Path):
    """gopherplug keeps its CDI spec on exit (a restart must not take devices from running pods): the
    test removes it, since the DRA driver's spec names the same devices (same kind, same IDs) and the
    runtime would take the one of the later directory."""
    try:
        yield
    finally:
        for spec in cdi_dir.iterdir():
            spec.unlink()


@pytest.mark.parametrize(
    "spec_dir",
    [
        pytest.param(gp.CDIConfig.spec_dir, id="default-spec-dir"),
        pytest.param("/var/lib/kubelet/device-plugins/cdi", id="spec-dir-in-the-device-plugin-dir"),
    ],
)
async def test_a_device_plugin_cdi_device_reaches_a_consumer(tier, nursery, spec_dir):
    """The CDI spec gopherplug writes for a device-plugin resource loads in containerd: a consumer
    created with nothing but the CDI device name of the Allocate answer gets the node and the env
    through containerd's CDI handling.

    Both at the default spec_dir, mounted from the host with the lines docs/deployment.md's
    step 4 gives (daemonset.yaml's example has no `cdi:` and leaves it out, so nothing is created
    on nodes without CDI; without them the pod exits with "cannot write the CDI spec
    /var/run/cdi/...: Read-only file system"), and at a spec_dir in the device-plugin directory,
    which this containerd reads too."""
    default = spec_dir == gp.CDIConfig.spec_dir
    node = Node(tier, "daemonset.yaml", "" if default else DP_CDI_CASE)
    node.config["resources"][0]["cdi"] = {"kind": RESOURCE, "spec_dir": spec_dir}
    if default:
        node.add_readme_cdi_mount()
    path = node.mknod("gopher0")
    kubelet = await nursery.start(gp.KubeletSimulator(str(node.device_plugin_dir)).run)
    host_cdi_dir = tier.containerd.cdi_dir if default else tier.containerd.extra_cdi_dirs[-1]
    with trio.fail_after(TIMEOUT), _removed_afterwards(host_cdi_dir):
        async with node.running():
            await kubelet.wait_until(lambda k: kubelet_lists(k, "gopher0"))
            answer = (await kubelet.allocate(RESOURCE, ["gopher0"])).container_responses[0]
            fields = allocated_fields(answer)
            tier.outputs[f"device plugin with cdi ({spec_dir}): Allocate answer"] = {
                "devices": len(fields["devices"]),
                "envs": dict(answer.envs),
                "cdi_devices": [d.name for d in answer.cdi_devices],
            }
            assert [d.name for d in fields["CDI_devices"]] == [f"{RESOURCE}=gopher0"]
            # Only the CDI device: what reaches the consumer then comes from the spec gopherplug wrote.
            pod = Pod(tier, "cdi-consumer")
            config = consumer_config(pod, CDI_devices=fields["CDI_devices"])
            async with running_pod(tier.containerd, pod, pod.sandbox_config(), [config]):
                seen = await consumer_report(tier.containerd, pod.container_ids["consumer"], str(path))
    tier.outputs[f"device plugin with cdi ({spec_dir}): consumer"] = seen
    assert any(line.startswith("GOPHER_DEVICES") and line.endswith("=gopher0") for line in seen["env"])
    assert seen["ls exit"] == 0 and " 10, 229 " in seen["ls -l"]
    assert (seen["open exit"], seen["open rw"]) == (0, "opened rw")


@pytest.mark.parametrize("through", ["device-spec", "cdi"])
async def test_a_consumer_sees_the_node_with_the_host_mode(tier, nursery, through):
    """A node the host keeps at 0660 (as udev does for serial ports and render nodes) must not become
    writable by every user of the consumer. Given as a DeviceSpec, the runtime copies the host
    node's mode and owner; given as a CDI device, the spec's fileMode, uid and gid decide (without
    them: 0666 root:root, runc's default)."""
    node = Node(tier, "daemonset.yaml", DP_CDI_CASE)
    node.config["resources"][0]["cdi"] = {"kind": RESOURCE, "spec_dir": "/var/lib/kubelet/device-plugins/cdi"}
    name = f"serial-{through}"
    path = node.mknod(name)
    path.chmod(0o660)
    os.chown(path, HOST_UID, HOST_GID)
    kubelet = await nursery.start(gp.KubeletSimulator(str(node.device_plugin_dir)).run)
    with trio.fail_after(TIMEOUT), _removed_afterwards(tier.containerd.extra_cdi_dirs[-1]):
        async with node.running():
            await kubelet.wait_until(lambda k: kubelet_lists(k, name))
            fields = allocated_fields((await kubelet.allocate(RESOURCE, [name])).container_responses[0])
            if through == "cdi":
                fields["devices"] = []
            else:
                fields["CDI_devices"] = []
            pod = Pod(tier, "mode-consumer")
            async with running_pod(tier.containerd, pod, pod.sandbox_config(), [consumer_config(pod, **fields)]):
                _, listed = await exec_sync(tier.containerd, pod.container_ids["consumer"], "ls", "-ln", str(path))
    tier.outputs[f"a 0660 node given through {through}"] = listed.strip()
    assert listed.startswith("crw-rw---- "), listed
    assert listed.split()[2:4] == [str(HOST_UID), str(HOST_GID)], listed  # the host node's owner and group


########################################################################################################
# The DRA driver, as daemonset-dra.yaml ships it


def metadata_spec_host_view(cdi_dir: Path, in_pod: str, host_side: Path) -> None:
    """The DRA pod's device metadata CDI specs (kind <driver>/metadata) in ``cdi_dir``, with each
    mount's hostPath under the pod's kubelet root read through ``host_side`` (_api_server_for).
    Replaced by rename, as gopherplug writes them: containerd's CDI cache sees whole files only."""
    for path in cdi_dir.glob(f"{DRIVER.replace('/', '-')}-metadata_*.json"):
        spec = json.loads(path.read_text())
        for device in spec["devices"]:
            for mount in device["containerEdits"].get("mounts", []):
                if mount["hostPath"].startswith(in_pod + "/"):
                    mount["hostPath"] = str(host_side) + mount["hostPath"][len(in_pod) :]
        temporary = path.with_name(f".{path.name}.host-view")
        temporary.write_text(json.dumps(spec))
        temporary.replace(path)


async def _api_server_for(node: Node, nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Path]:
    """An API server stand-in over TLS, with what the kubelet gives the DRA pod to reach it: the
    service's address in env (pkg/kubelet/kubelet_pods.go getServiceEnvVarMap, the `kubernetes`
    service), and the service account's projected token and ca.crt. And where a kubelet stand-in
    finds the node's kubelet directory (below)."""
    import trustme

    ca = trustme.CA()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    token = secrets.token_urlsafe(24)
    api = await nursery.start(standins.ApiServerSimulator(ssl_context=context, tokens={token}).run)
    node.service_env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(api.port)}
    node.service_account = {"token": token, "ca.crt": ca.cert_pem.bytes().decode(), "namespace": "kube-system"}
    # On a node the kubelet sees the plugin's sockets at the paths the pod made them, as hostPath
    # and mountPath are equal; here the host side is a private directory, so the kubelet stand-in
    # works on the host side: the translation's one concession. Through a symlink no longer than
    # the pod's kubelet root: the pod names its sockets to fit a unix socket's 108 bytes from there
    # (with POD_UID, "<driver>-<pod UID>-reg.sock" leaves little room), and the run's directory is
    # longer. The endpoint GetInfo names is read on the same side.
    # The second concession, for the same reason: a claim's device metadata CDI spec names the
    # metadata file's hostPath as the pod sees it (/var/lib/kubelet/plugins/...), which on a node is
    # the host's path too; here it is read through the same symlink. The spec is rewritten in the
    # CDI directory once the claim is prepared, before any consumer is created, only that prefix.
    in_pod = node.config["dra"]["kubelet_dir"]
    host_side = Path("/tmp") / f"gk{secrets.token_hex(4)}"
    host_side.symlink_to(node.kubelet_dir)
    node.tier.links.append(host_side)
    assert len(str(host_side)) <= len(in_pod)
    call_unary = gp.call_unary

    async def host_view(socket_path: str, method: Any, request: Any, *, timeout: float) -> Any:
        answer = await call_unary(socket_path, method, request, timeout=timeout)
        if method is gp.DRA_METHODS[gp.GET_INFO]:
            answer.endpoint = answer.endpoint.replace(in_pod, str(host_side), 1)
        if method.name == "NodePrepareResources":
            metadata_spec_host_view(node.tier.containerd.cdi_dir, in_pod, host_side)
        return answer

    monkeypatch.setattr(gp, "call_unary", host_view)
    return api, host_side


async def dra_cluster(
    node: Node, nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> tuple[standins.ApiServerSimulator, standins.DraKubeletSimulator]:
    """Around the shipped DRA pod on ``node``: the API server stand-in of _api_server_for with the
    node's Node, and the DRA kubelet stand-in on the node's kubelet directory, running."""
    api, host_side = await _api_server_for(node, nursery, monkeypatch)
    api.put_node(NODE_NAME, str(uuid.uuid4()))  # registered by the kubelet: the slices' owner
    kubelet = standins.DraKubeletSimulator(str(host_side), wipe=lambda d: api.delete_node_slices(NODE_NAME, d))
    await nursery.start(kubelet.run)
    return api, kubelet


async def stored_devices(api: Any, pool: str, wanted: Any) -> dict[str, dict[str, Any]]:
    """The devices of ``pool`` as the API server stand-in stores them (by name, across the pool's
    slices), once ``wanted(devices)`` holds; woken by each write."""
    while True:
        devices = {
            device["name"]: device
            for item in api.slices.values()
            if item["spec"]["pool"]["name"] == pool
            for device in item["spec"]["devices"]
        }
        if wanted(devices):
            return devices
        await api.changed.wait_touched()


def dra_claim(name: str, requests: list[dict[str, Any]], results: list[dict[str, Any]]) -> dict[str, Any]:
    """A ResourceClaim in namespace default as the scheduler leaves it: its requests, and the
    allocation's results (each a request's name, the driver, pool and device, and what the scheduler
    copies from the request: adminAccess, tolerations)."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"namespace": "default", "name": name, "uid": str(uuid.uuid4())},
        "spec": {"devices": {"requests": requests}},
        "status": {"allocation": {"devices": {"results": results}}},
    }


def _shipped_device_class() -> dict[str, Any]:
    """The shipped DeviceClass that ordinary claims name (the manifest's first; the second,
    "<name>-admin", is for admin-access claims)."""
    classes = [doc for doc in manifest_docs("daemonset-dra.yaml") if doc["kind"] == "DeviceClass"]
    assert [c["metadata"]["name"] for c in classes] == ["gopher.example.com", "gopher.example.com-admin"]
    return classes[0]


def _device_class() -> str:
    return str(_shipped_device_class()["metadata"]["name"])


async def test_dra_pod_registers_publishes_prepares_and_a_consumer_gets_its_cdi_device(tier, nursery, monkeypatch):
    """The shipped DRA pod registers through plugins_registry, writes its ResourceSlice to the API
    server stand-in over TLS with the projected token and ca.crt, prepares an allocated claim; a
    consumer created with the claim's CDI device IDs (CRI CDI_devices, as the kubelet passes them)
    gets the node through containerd's own CDI handling. A containerd with enable_cdi = false runs
    the same consumer without device and without env, and says nothing."""
    node = Node(tier, "daemonset-dra.yaml")
    path = node.mknod("gopher0")
    path.chmod(0o660)  # the host's mode reaches the consumer through the CDI spec, as a DeviceSpec's would
    os.chown(path, HOST_UID, HOST_GID)
    api, kubelet = await dra_cluster(node, nursery, monkeypatch)
    pool = gp.dra_pool_name(NODE_NAME, RESOURCE)
    device = gp.dra_device_name("gopher0")

    def published() -> bool:
        return any(s["spec"]["pool"]["name"] == pool and s["spec"]["devices"] for s in api.slices.values())

    with trio.fail_after(TIMEOUT):
        async with node.running() as plugin:
            started = time.monotonic()

            async def registered() -> None:
                await kubelet.wait_until(lambda k: DRIVER in k.drivers)

                tier.figures["DRA: container started -> registered (ms)"] = ms_since(started)

            async def slice_published() -> None:
                while not published():
                    await api.changed.wait_touched()
                tier.figures["DRA: container started -> slice published (ms)"] = ms_since(started)

            async with trio.open_nursery() as both:
                both.start_soon(registered)
                both.start_soon(slice_published)
            tier.figures["DRA: idle RSS, 1 device (MiB)"] = await _rss(tier.containerd, plugin)
            (written,) = [s for s in api.slices.values() if s["spec"]["pool"]["name"] == pool]
            assert written["spec"]["nodeName"] == NODE_NAME
            assert [d["name"] for d in written["spec"]["devices"]] == [device]
            code, said = await liveness_probe(node)
            assert code == 200, said
            tier.outputs["DRA: liveness probe"] = f"{code} {said.strip()}"
            code, said = await exec_sync(tier.containerd, plugin, "gopherplug", "probe", timeout=10)
            assert code == 0, said
            tier.outputs["DRA: gopherplug probe"] = said.strip().splitlines()
            uid = str(uuid.uuid4())
            api.put_claim(
                {
                    "apiVersion": "resource.k8s.io/v1",
                    "kind": "ResourceClaim",
                    "metadata": {"namespace": "default", "name": "gopher", "uid": uid},
                    # A prioritized list (firstAvailable, GA in 1.36): the scheduler names the
                    # subrequest it satisfied in the result, "gopher/any"; the pod's container asks
                    # for the claim's request "gopher" only.
                    "spec": {
                        "devices": {
                            "requests": [
                                {
                                    "name": "gopher",
                                    "firstAvailable": [
                                        {"name": "fast", "deviceClassName": "fast-gopher"},
                                        {"name": "any", "deviceClassName": "gopher"},
                                    ],
                                }
                            ]
                        }
                    },
                    "status": {
                        "allocation": {
                            "devices": {
                                "results": [{"request": "gopher/any", "driver": DRIVER, "pool": pool, "device": device}]
                            }
                        }
                    },
                }
            )
            prepared = (await kubelet.prepare(DRIVER, [("default", uid, "gopher")])).claims[uid]
            assert prepared.error == ""
            # What the kubelet gives a container whose resources.claims[] entry names request
            # "gopher": the CDI IDs of the devices whose request names contain it (cdiDevicesAsList
            # in pkg/kubelet/cm/dra/claiminfo.go). Had the driver answered "gopher/any", none.
            ids = kubelet.cdi_devices(uid, "gopher")
            assert ids == [i for d in prepared.devices for i in d.cdi_device_ids] != []
            tier.outputs["DRA: CDI device IDs"] = ids
            # The kubelet passes a claim's CDI devices in the CRI's CDI_devices field only
            # (kuberuntime_container.go makeCDIDevices; no annotations).
            cdi = [rs.PB.CDIDevice(name=i) for i in ids]
            pod = Pod(tier, "dra-consumer")
            config = consumer_config(pod, CDI_devices=cdi)
            async with running_pod(tier.containerd, pod, pod.sandbox_config(), [config]):
                consumer = pod.container_ids["consumer"]
                seen = await consumer_report(tier.containerd, consumer, str(path))
                # Its device metadata (KEP-5304), as the container itself reads it at the path the
                # protocol gives; and read-only there.
                metadata_path = f"{gp.DRA_METADATA_CONTAINER_DIR}/resourceclaims/gopher/gopher/{DRIVER}-metadata.json"
                read_code, metadata_text = await exec_sync(tier.containerd, consumer, "cat", metadata_path)
                write_code, refused = await exec_sync(tier.containerd, consumer, "sh", "-c", f"echo >> {metadata_path}")
            tier.outputs["DRA: consumer"] = seen
            tier.outputs["DRA: the consumer's device metadata"] = metadata_text.splitlines()
            # enable_cdi = false (containerd 1.7's default), the same spec directory: nothing fails.
            second = tier.containerd_for(tier.root / "ctrd2", enable_cdi=False)
            second.extra_cdi_dirs.append(tier.containerd.cdi_dir)
            tier.second = second
            await trio.to_thread.run_sync(second.start)
            for image in ("pause", "busybox"):
                await trio.to_thread.run_sync(second.import_image, tier.archives[image])
            pod = Pod(tier, "dra-consumer-no-cdi")
            config = consumer_config(pod, CDI_devices=cdi)
            async with running_pod(second, pod, pod.sandbox_config(), [config]):
                state = (await container_status(second, pod.container_ids["consumer"])).status.state
                unseen = await consumer_report(second, pod.container_ids["consumer"], str(path))
            tier.outputs["DRA: consumer under enable_cdi = false"] = unseen
    assert seen["ls exit"] == 0 and seen["ls -l"].startswith("crw-rw---- ") and " 10, 229 " in seen["ls -l"]
    assert (seen["open exit"], seen["open rw"]) == (0, "opened rw")
    assert {"GOPHER_DEVICES=gopher0", "GOPHER_DEVICES_GOPHER0=gopher0"} <= set(seen["env"]), seen
    # The metadata file, through containerd's CDI handling: the claim, the subrequest the scheduler
    # chose, and the device with the attributes the API server stand-in stored in its slice.
    assert read_code == 0, metadata_text
    beta = json.JSONDecoder().raw_decode(metadata_text)[0]
    assert (beta["kind"], beta["apiVersion"]) == ("DeviceMetadata", "metadata.resource.k8s.io/v1beta1")
    assert beta["metadata"] == {"name": "gopher", "namespace": "default", "uid": uid, "generation": 1}
    [request] = beta["requests"]
    assert request["name"] == "gopher/any"
    assert request["devices"] == [
        {"driver": DRIVER, "pool": pool, "name": device, "attributes": written["spec"]["devices"][0]["attributes"]}
    ]
    assert write_code != 0 and "Read-only file system" in refused, refused
    assert api.refused_tokens == 0  # every request from the pod carried the projected token
    assert state == rs.PB.ContainerState.CONTAINER_RUNNING
    assert unseen["ls exit"] != 0 and "No such file or directory" in unseen["ls -l"]
    assert not any(line.startswith("GOPHER") for line in unseen["env"]), unseen["env"]
    assert not_granted_refused(seen) and not_granted_refused(unseen)
    # The CDI spec's device node rule, under the CDI-enabled containerd only.
    rule = f"c {DEVICE_MAJOR}:{DEVICE_MINOR} rw"
    assert rule in seen["device rules (host side)"] and rule not in unseen["device rules (host side)"]


#: How many consumers share the one device in the test below
SHARES = 3


async def test_dra_one_device_shared_by_three_claims_reaches_three_consumers_each_with_its_share(
    tier, nursery, monkeypatch
):
    """replicas: 3 in the shipped DRA pod's configuration (its one edit besides the directory): the
    slice offers gopher0 to 3 claims at once (KEP-5075). Three claims of the shipped DeviceClass,
    each allocated by the scheduler stand-in from the stored slice (a share of its own: a shareID,
    1 share consumed), are prepared, and a fourth is not allocated; three consumer
    pods, each created with its claim's CDI devices, all open the one node, and containerd reports
    for each another CDI device, whose env names that consumer's share. Unprepared, the shares'
    CDI devices are gone from the runtime's spec directory."""
    node = Node(tier, "daemonset-dra.yaml")
    node.config["resources"][0]["replicas"] = SHARES
    # The tier's pods are on the host's network, where another run of the tier may hold the
    # manifest's metrics port: a free one (metrics are not what this test is about).
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        node.config["metrics_address"] = f"127.0.0.1:{free.getsockname()[1]}"
    path = node.mknod("gopher0")
    api, kubelet = await dra_cluster(node, nursery, monkeypatch)
    pool, device = gp.dra_pool_name(NODE_NAME, RESOURCE), gp.dra_device_name("gopher0")
    kind = node.config["resources"][0]["cdi"]["kind"]
    scheduler = standins.SchedulerSimulator(api, [_shipped_device_class()])

    def made(name: str) -> dict[str, Any]:
        """A claim for one device of the shipped class, asking no capacity: the policy's default."""
        request = {"name": "gopher", "exactly": {"deviceClassName": _device_class()}}
        return {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"namespace": "default", "name": name, "uid": str(uuid.uuid4())},
            "spec": {"devices": {"requests": [request]}},
        }

    claims: list[tuple[str, str, str]] = []  # name, UID, shareID

    def shared() -> list[dict[str, Any]]:
        mine = [s for s in api.slices.values() if s["spec"]["pool"]["name"] == pool]
        return [d for s in mine for d in s["spec"]["devices"] if d.get("allowMultipleAllocations")]

    seen: dict[str, dict[str, Any]] = {}
    reported: dict[str, dict[str, Any]] = {}
    with trio.fail_after(TIMEOUT):
        async with node.running():
            await kubelet.wait_until(lambda k: DRIVER in k.drivers)
            while not shared():
                await api.changed.wait_touched()
            (published,) = shared()
            tier.outputs["DRA shares: the slice's device as stored"] = published
            results = {}
            for number in range(SHARES):
                claim = made(f"gopher-{number}")
                claim["status"] = {"allocation": scheduler.allocate(claim, NODE_NAME)}
                api.put_claim(claim)
                (result,) = claim["status"]["allocation"]["devices"]["results"]
                assert (result["pool"], result["device"]) == (pool, device), result
                claims.append((claim["metadata"]["name"], claim["metadata"]["uid"], result["shareID"]))
                results[claim["metadata"]["name"]] = result
            with pytest.raises(standins.UnschedulableError, match=r"^cannot allocate all claims$"):
                scheduler.allocate(made(f"gopher-{SHARES}"), NODE_NAME)  # the device's shares are all taken
            tier.outputs["DRA shares: allocation results"] = list(results.values())
            answer = await kubelet.prepare(DRIVER, [("default", uid, name) for name, uid, _ in claims])
            assert all(not answer.claims[uid].error for _, uid, _ in claims), answer
            async with contextlib.AsyncExitStack() as pods:
                for name, uid, _ in claims:
                    pod = Pod(tier, f"dra-{name}")
                    cdi = [rs.PB.CDIDevice(name=i) for i in kubelet.cdi_devices(uid, "gopher")]
                    await pods.enter_async_context(
                        running_pod(tier.containerd, pod, pod.sandbox_config(), [consumer_config(pod, CDI_devices=cdi)])
                    )
                    container = pod.container_ids["consumer"]
                    seen[name] = await consumer_report(tier.containerd, container, str(path))
                    info = json.loads((await container_status(tier.containerd, container, verbose=True)).info["info"])
                    reported[name] = {
                        "CDI devices": [d["name"] for d in info["config"].get("CDI_devices", [])],
                        "env": sorted(e for e in info["runtimeSpec"]["process"]["env"] if e.startswith("GOPHER")),
                    }
            tier.outputs["DRA shares: consumers"] = seen
            tier.outputs["DRA shares: containerd's report"] = reported
            gone = await kubelet.unprepare(DRIVER, [("default", uid, name) for name, uid, _ in claims])
            assert all(not gone.claims[uid].error for _, uid, _ in claims), gone
            left = sorted(p.name for p in tier.containerd.cdi_dir.iterdir() if any(u in p.name for _, u, _ in claims))
    assert published["capacity"] == {
        gp.DRA_SHARES_CAPACITY: {
            "value": str(SHARES),
            "requestPolicy": {"default": "1", "validRange": {"min": "1", "max": str(SHARES), "step": "1"}},
        }
    }
    for name, uid, share in claims:
        assert seen[name]["ls exit"] == 0 and f" {DEVICE_MAJOR}, {DEVICE_MINOR} " in seen[name]["ls -l"], seen[name]
        assert (seen[name]["open exit"], seen[name]["open rw"]) == (0, "opened rw"), seen[name]
        assert f"GOPHER_DEVICES_GOPHER0_SHARE={share}" in seen[name]["env"], seen[name]["env"]
        # Its share's CDI device, its request's env, and its device metadata's mount (dra.device_metadata,
        # on by default).
        metadata = f"{DRIVER}/metadata={uid}_gopher"
        assert reported[name]["CDI devices"] == [f"{kind}=gopher0-{share}", f"{kind}={uid}_gopher", metadata]
        assert f"GOPHER_DEVICES_GOPHER0_SHARE={share}" in reported[name]["env"], reported[name]
        assert "GOPHER_DEVICES=gopher0" in reported[name]["env"], reported[name]  # the device, once
        # Each share's CDI device node rule, in each consumer's device rules.
        assert f"c {DEVICE_MAJOR}:{DEVICE_MINOR} rw" in seen[name]["device rules (host side)"], seen[name]
    assert len({tuple(r["CDI devices"]) for r in reported.values()}) == SHARES  # three names, one device
    assert left == []


async def test_dra_a_claim_of_two_devices_gives_its_container_the_env_allocate_gives(tier, nursery, monkeypatch):
    """On a real containerd. The device-plugin pod (daemonset.yaml) is asked by the
    kubelet stand-in to Allocate gopher1 and gopher0, and a consumer created with its answer reports
    GOPHER_DEVICES. The DRA pod (daemonset-dra.yaml, on a node of its own) prepares a claim whose
    request "gopher" the scheduler gave gopher1, then gopher0, and whose request "more" it gave
    gopher2: a consumer created with the CDI devices of request "gopher" (whose pod sets a
    GOPHER_DEVICES of its own) reports the same GOPHER_DEVICES, through containerd's CDI, with each
    device's GOPHER_DEVICES_<ID>. One created with the whole claim's reports "more"'s list:
    containerd keeps the last value of a variable that two CDI devices set, as the unit tests'
    runtime (cdi_container_env) says, the README too."""
    plugin_node = Node(tier, "daemonset.yaml")
    del plugin_node.config["metrics_address"]  # the host's network, shared: not what this test is about
    dra_node = Node(tier, "daemonset-dra.yaml")
    for node in (plugin_node, dra_node):
        for name in ("gopher0", "gopher1", "gopher2"):
            node.mknod(name)
    kubelet = await nursery.start(gp.KubeletSimulator(str(plugin_node.device_plugin_dir)).run)
    api, dra_kubelet = await dra_cluster(dra_node, nursery, monkeypatch)
    pool = gp.dra_pool_name(NODE_NAME, RESOURCE)
    reported: dict[str, dict[str, Any]] = {}

    async def consumer(name: str, **fields: Any) -> list[str]:
        """The env the consumer's container reports (`env` run inside it), and containerd's spec of it."""
        pod = Pod(tier, name)
        config = consumer_config(pod, **fields)
        async with running_pod(tier.containerd, pod, pod.sandbox_config(), [config]):
            container = pod.container_ids["consumer"]
            _, env = await exec_sync(tier.containerd, container, "env")
            info = json.loads((await container_status(tier.containerd, container, verbose=True)).info["info"])
        reported[name] = {
            "CDI devices": [d["name"] for d in info["config"].get("CDI_devices", [])],
            "runtime spec env": [e for e in info["runtimeSpec"]["process"]["env"] if e.startswith("GOPHER")],
        }
        return sorted(line for line in env.splitlines() if line.startswith("GOPHER"))

    with trio.fail_after(TIMEOUT):
        async with plugin_node.running():
            await kubelet.wait_until(lambda k: kubelet_lists(k, "gopher0", "gopher1", "gopher2"))
            answer = (await kubelet.allocate(RESOURCE, ["gopher1", "gopher0"])).container_responses[0]
            by_allocate = await consumer("env-device-plugin", **allocated_fields(answer))
        async with dra_node.running():
            await dra_kubelet.wait_until(lambda k: DRIVER in k.drivers)
            await stored_devices(api, pool, lambda devices: len(devices) == 3)
            results = [
                {"request": "gopher", "driver": DRIVER, "pool": pool, "device": "gopher1"},
                {"request": "gopher", "driver": DRIVER, "pool": pool, "device": "gopher0"},
                {"request": "more", "driver": DRIVER, "pool": pool, "device": "gopher2"},
            ]
            requests = [
                {"name": "gopher", "exactly": {"deviceClassName": _device_class(), "count": 2}},
                {"name": "more", "exactly": {"deviceClassName": _device_class()}},
            ]
            claim = dra_claim("gophers", requests, results)
            api.put_claim(claim)
            uid = claim["metadata"]["uid"]
            prepared = (await dra_kubelet.prepare(DRIVER, [("default", uid, "gophers")])).claims[uid]
            assert prepared.error == ""
            own = [rs.PB.KeyValue(key="GOPHER_DEVICES", value="the pod's own")]
            ids = dra_kubelet.cdi_devices(uid, "gopher")
            by_claim = await consumer("env-dra", CDI_devices=[rs.PB.CDIDevice(name=i) for i in ids], envs=own)
            whole_ids = dra_kubelet.cdi_devices(uid)
            whole = await consumer("env-dra-whole", CDI_devices=[rs.PB.CDIDevice(name=i) for i in whole_ids])
            spec_dirs = [str(tier.containerd.cdi_dir)]
            said = {  # what the unit tests' runtime says of the same CDI devices, against the same files
                "gopher": standins.cdi_container_env(spec_dirs, ids, ["GOPHER_DEVICES=the pod's own"]),
                "whole": standins.cdi_container_env(spec_dirs, whole_ids),
            }
    tier.outputs["DRA env: consumer given the Allocate answer"] = by_allocate
    tier.outputs["DRA env: consumer given request gopher's CDI devices"] = by_claim
    tier.outputs["DRA env: consumer given the whole claim's CDI devices"] = whole
    tier.outputs["DRA env: containerd's report"] = reported
    assert dict(answer.envs) == {"GOPHER_DEVICES": "gopher1,gopher0"}
    assert "GOPHER_DEVICES=gopher1,gopher0" in by_allocate, by_allocate
    assert by_claim == [
        "GOPHER_DEVICES=gopher1,gopher0",  # Allocate's string, the pod's own replaced
        "GOPHER_DEVICES_GOPHER0=gopher0",
        "GOPHER_DEVICES_GOPHER1=gopher1",
    ], by_claim
    assert whole == [
        "GOPHER_DEVICES=gopher2",  # the last request's: containerd keeps a variable's last value
        "GOPHER_DEVICES_GOPHER0=gopher0",
        "GOPHER_DEVICES_GOPHER1=gopher1",
        "GOPHER_DEVICES_GOPHER2=gopher2",
    ], whole
    assert sorted(e for e in said["gopher"] if e.startswith("GOPHER")) == by_claim
    assert sorted(said["whole"]) == whole
    assert reported["env-dra"]["CDI devices"] == ids


@pytest.mark.parametrize("effect", ["NoSchedule", "NoExecute"])
async def test_dra_pod_taints_an_unhealthy_device_and_an_admin_claim_still_reaches_it(
    tier, nursery, monkeypatch, effect
):
    """The DRA rows the unit tests show with stand-ins, on the shipped pod in a real containerd:

    - claim c1 on gopher0 is prepared, its consumer opens gopher0, and the claim's status.devices
      as the API server stand-in stores it says which node file it is (KEP-4817);
    - gopher1 becomes unhealthy as the pod's health check sees it (mode 0000: root without
      capabilities may not open it): the stored slice gives it the taint <driver>/unhealthy,
      NoSchedule as shipped, NoExecute with dra.unhealthy_taint in the ConfigMap (KEP-5055);
    - an admin-access claim (KEP-5018) whose request tolerates the taint, allocated gopher0 (in use
      by c1) and gopher1 (tainted), is prepared, and its consumer, running beside c1's, opens both
      (the runtime's root keeps CAP_DAC_OVERRIDE, which the plugin's drops);
    - claim c3, allocated gopher1 while it was healthy, is refused with the reason (NoSchedule
      takes no allocation away; NoExecute has the eviction controller delete c3's pod, but a
      prepare the kubelet asks before that is refused all the same);
    - gopher1 recovers (its mode back): the stored slice has no taint on it any more, and c3's
      prepare, tried again as the kubelet does, succeeds."""
    node = Node(tier, "daemonset-dra.yaml")
    if effect != "NoSchedule":  # the default, and the shipped ConfigMap's
        node.config["dra"]["unhealthy_taint"] = effect
    paths = {name: node.mknod(name) for name in ("gopher0", "gopher1", "gopher2")}
    for path in paths.values():
        path.chmod(0o660)
        os.chown(path, HOST_UID, HOST_GID)
    api, kubelet = await dra_cluster(node, nursery, monkeypatch)
    pool = gp.dra_pool_name(NODE_NAME, RESOURCE)
    a, b = gp.dra_device_name("gopher0"), gp.dra_device_name("gopher1")
    taint_key = f"{DRIVER}/unhealthy"
    device_class = _device_class()
    plain = {"name": "gopher", "exactly": {"deviceClassName": device_class}}
    tolerations = [{"key": taint_key, "operator": "Exists"}]
    monitor = {
        "name": "monitor",
        "exactly": {
            "deviceClassName": f"{device_class}-admin",  # the shipped class for admin access
            "adminAccess": True,
            "count": 2,
            "selectors": [{"cel": {"expression": f'device.attributes["{DRIVER}"].id in ["gopher0", "gopher1"]'}}],
            "tolerations": tolerations,
        },
    }

    def result(request: str, device: str, **copied: Any) -> dict[str, Any]:
        return {"request": request, "driver": DRIVER, "pool": pool, "device": device, **copied}

    c1 = dra_claim("c1", [plain], [result("gopher", a)])
    c3 = dra_claim("c3", [plain], [result("gopher", b)])
    admin = dra_claim(
        "admin",
        [monitor],
        [result("monitor", d, adminAccess=True, tolerations=tolerations) for d in (a, b)],
    )
    for claim in (c1, c3, admin):
        api.put_claim(claim)
    uid = {claim["metadata"]["name"]: claim["metadata"]["uid"] for claim in (c1, c3, admin)}
    seen: dict[str, Any] = {}
    with trio.fail_after(2 * TIMEOUT), _removed_afterwards(tier.containerd.cdi_dir):
        async with node.running():
            await kubelet.wait_until(lambda k: DRIVER in k.drivers)
            healthy = await stored_devices(api, pool, lambda found: len(found) == 3)
            prepared = (await kubelet.prepare(DRIVER, [("default", uid["c1"], "c1")])).claims[uid["c1"]]
            assert prepared.error == ""
            first = Pod(tier, "c1-consumer")
            config = consumer_config(
                first, CDI_devices=[rs.PB.CDIDevice(name=i) for i in kubelet.cdi_devices(uid["c1"])]
            )
            async with running_pod(tier.containerd, first, first.sandbox_config(), [config]):
                seen["c1: gopher0"] = await consumer_report(
                    tier.containerd, first.container_ids["consumer"], str(paths["gopher0"])
                )
                paths["gopher1"].chmod(0)
                tainted = await stored_devices(api, pool, lambda found: "taints" in found[b])
                answer = await kubelet.prepare(DRIVER, [("default", uid["admin"], "admin")])
                assert answer.claims[uid["admin"]].error == ""
                ids = kubelet.cdi_devices(uid["admin"], "monitor")
                second = Pod(tier, "admin-consumer")
                config = consumer_config(second, CDI_devices=[rs.PB.CDIDevice(name=i) for i in ids])
                async with running_pod(tier.containerd, second, second.sandbox_config(), [config]):
                    for name in ("gopher0", "gopher1"):
                        seen[f"admin: {name}"] = await consumer_report(
                            tier.containerd, second.container_ids["consumer"], str(paths[name])
                        )
                    state = (await container_status(tier.containerd, first.container_ids["consumer"])).status.state
            refused = (await kubelet.prepare(DRIVER, [("default", uid["c3"], "c3")])).claims[uid["c3"]]
            # status.devices is written after the kubelet has its answer: wait for the stored claims.
            while not all("devices" in api.claims["default", n]["status"] for n in ("c1", "admin")):
                await api.changed.wait_touched()
            statuses = {n: api.claims["default", n]["status"]["devices"] for n in ("c1", "admin")}
            paths["gopher1"].chmod(0o660)
            recovered = await stored_devices(api, pool, lambda found: "taints" not in found[b])
            # The kubelet retries a failed prepare while the pod waits: now it gets the device.
            retried = (await kubelet.prepare(DRIVER, [("default", uid["c3"], "c3")])).claims[uid["c3"]]
    tier.outputs[f"DRA rows ({effect}): slice devices before"] = healthy
    tier.outputs[f"DRA rows ({effect}): slice device gopher1, unhealthy"] = tainted[b]
    tier.outputs[f"DRA rows ({effect}): slice device gopher1, recovered"] = recovered[b]
    tier.outputs[f"DRA rows ({effect}): allocations"] = {
        n: api.claims["default", n]["status"]["allocation"] for n in ("c1", "admin", "c3")
    }
    tier.outputs[f"DRA rows ({effect}): admin claim CDI device IDs"] = ids
    tier.outputs[f"DRA rows ({effect}): c3 refused"] = refused.error
    tier.outputs[f"DRA rows ({effect}): claim status.devices"] = statuses
    tier.outputs[f"DRA rows ({effect}): consumers"] = seen
    assert not any("taints" in device for device in healthy.values())
    (taint,) = tainted[b]["taints"]
    assert taint["timeAdded"]  # the API server's
    assert {k: v for k, v in taint.items() if k != "timeAdded"} == {
        "key": taint_key,
        "value": "unhealthy",
        "effect": effect,
    }
    assert tainted[b]["attributes"]["healthy"] == {"bool": False}
    assert not any("taints" in tainted[n] for n in (a, gp.dra_device_name("gopher2")))
    assert recovered[b]["attributes"]["healthy"] == {"bool": True}
    # Both consumers open their devices, c1's still running beside the admin's.
    for what in ("c1: gopher0", "admin: gopher0", "admin: gopher1"):
        assert (seen[what]["ls exit"], seen[what]["open exit"], seen[what]["open rw"]) == (0, 0, "opened rw"), what
    assert state == rs.PB.ContainerState.CONTAINER_RUNNING
    env = seen["admin: gopher0"]["env"]
    assert {"GOPHER_DEVICES_GOPHER0=gopher0", "GOPHER_DEVICES_GOPHER1=gopher1"} <= set(env), env
    assert refused.error.startswith(f"ResourceClaim default/c3: device gopher1 of {RESOURCE} is unhealthy: "), refused
    assert str(paths["gopher1"]) in refused.error and not refused.devices
    assert (retried.error, [d.device_name for d in retried.devices]) == ("", [b])

    def entry(device: str, name: str) -> dict[str, Any]:
        return {"driver": DRIVER, "pool": pool, "device": device, "data": {"id": name, "paths": [str(paths[name])]}}

    assert statuses == {"c1": [entry(a, "gopher0")], "admin": [entry(a, "gopher0"), entry(b, "gopher1")]}


def host_pci_backed_node() -> tuple[int, int, int, dict[str, Any]] | None:
    """A device node of this machine whose device is a PCI function's (a char device preferred: a
    block one is a disk), read from the host's sysfs apart from gopherplug's own walk: its type
    (stat.S_IFCHR or S_IFBLK), major and minor, and the standard attributes it must get
    (kubernetes/kubernetes staging/src/k8s.io/dynamic-resource-allocation/deviceattribute/pci.go):
    pciBusID the nearest function above it that /sys/bus/pci/devices lists, pcieRoot the directory
    under /sys/devices it hangs from, numaNode the function's when it has one. A node under a USB
    device has none (USB is not PCI even when its host controller is). None when there is no such node."""
    functions = Path("/sys/bus/pci/devices")
    listed = {entry.name for entry in functions.iterdir()} if functions.is_dir() else set()
    for kind, file_type in (("char", stat.S_IFCHR), ("block", stat.S_IFBLK)):
        for entry in sorted(Path("/sys/dev", kind).iterdir()):
            try:
                parts = (entry / "device").resolve(strict=True).relative_to("/sys/devices").parts
            except (OSError, ValueError):
                continue
            above = [Path("/sys/devices", *parts[: i + 1]) for i in range(len(parts))]
            if any((d / "subsystem").resolve().name == "usb" for d in above) or not listed & set(parts):
                continue
            bus_id = [part for part in parts if part in listed][-1]
            attributes: dict[str, Any] = {
                "resource.kubernetes.io/pciBusID": {"string": bus_id},
                "resource.kubernetes.io/pcieRoot": {"string": parts[0]},
            }
            numa = int((functions / bus_id / "numa_node").read_text())
            if numa >= 0:
                attributes["resource.kubernetes.io/numaNode"] = {"int": numa}
            major, minor = map(int, entry.name.split(":"))
            return file_type, major, minor, attributes
    return None


async def test_dra_pod_publishes_the_pci_address_of_a_host_device_node(tier, nursery, monkeypatch):
    """The standard attributes resource.kubernetes.io/pciBusID and pcieRoot (and numaNode) of a real
    PCI device's node, as the shipped pod finds them through its own /sys mount (the host's), in the
    slice the API server stand-in stores. The node is made in the run's directory of /dev with the
    real device's numbers, mode 0600: the plugin only looks at it (its device cgroup refuses it any
    open), and no consumer is given it."""
    found = host_pci_backed_node()
    if found is None:
        pytest.skip("this machine has no device node of a PCI device in /sys/dev (char or block)")
    file_type, major, minor, wanted = found
    node = Node(tier, "daemonset-dra.yaml")
    if file_type == stat.S_IFBLK:
        # A disk holds a mounted filesystem (here the one behind the pod's volumes), which gopherplug
        # skips unless told: told, in the ConfigMap, as the test gives the node to no consumer.
        node.config["resources"][0]["allow_mounted"] = True
    path = node.devices / "pci0"
    os.mknod(path, 0o600 | file_type, os.makedev(major, minor))
    api, kubelet = await dra_cluster(node, nursery, monkeypatch)
    pool = gp.dra_pool_name(NODE_NAME, RESOURCE)
    name = gp.dra_device_name("pci0")
    with trio.fail_after(TIMEOUT), _removed_afterwards(tier.containerd.cdi_dir):
        async with node.running():
            await kubelet.wait_until(lambda k: DRIVER in k.drivers)
            stored = (await stored_devices(api, pool, lambda devices: name in devices))[name]
    kind = "char" if file_type == stat.S_IFCHR else "block"
    tier.outputs["DRA standard attributes: host node"] = f"{kind} {major}:{minor} -> {wanted}"
    tier.outputs["DRA standard attributes: slice device"] = stored
    standard = {k: v for k, v in stored["attributes"].items() if k.startswith("resource.kubernetes.io/")}
    assert standard == wanted


def allocated_claim(name: str, uid: str, pool: str, device: str) -> dict[str, Any]:
    """A ResourceClaim as the scheduler leaves it: one request, allocated one device of the pool."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"namespace": "default", "name": name, "uid": uid},
        "spec": {"devices": {"requests": [{"name": "gopher", "exactly": {"deviceClassName": "gopher"}}]}},
        "status": {
            "allocation": {
                "devices": {"results": [{"request": "gopher", "driver": DRIVER, "pool": pool, "device": device}]}
            }
        },
    }


async def test_dra_rolling_update_two_pods_overlap_and_a_claim_prepared_meanwhile_reaches_a_consumer(
    tier, nursery, monkeypatch
):
    """daemonset-dra.yaml's rolling update (maxSurge: 1, maxUnavailable: 0) as the DaemonSet
    controller runs it on one node: the new pod starts while the old one serves, each with its own
    UID; both register, so the driver is never without a registered plugin. A claim prepared
    during the overlap reaches a consumer through containerd's CDI handling; the old pod then
    stops (SIGTERM, exit 0) and the new one unprepares both claims, the one the old pod prepared
    too, and still answers its liveness probe."""
    node = Node(tier, "daemonset-dra.yaml")
    (daemonset,) = [doc for doc in manifest_docs("daemonset-dra.yaml") if doc["kind"] == "DaemonSet"]
    strategy = daemonset["spec"]["updateStrategy"]
    assert strategy["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}  # else this overlap would not happen
    path = node.mknod("gopher0")
    node.mknod("gopher1")
    api, kubelet = await dra_cluster(node, nursery, monkeypatch)
    pool = gp.dra_pool_name(NODE_NAME, RESOURCE)
    registry = node.kubelet_dir / "plugins_registry"
    registry_seen = Path(kubelet.registry)  # the same directory, as the kubelet stand-in names it

    def registered_sockets() -> list[str]:
        return [os.path.basename(p.registration_socket) for p in kubelet.plugins.get(DRIVER, [])]

    new_pod = node.surge()
    old_socket, new_socket = (f"{DRIVER}-{pod.uid}-reg.sock" for pod in (node.pod, new_pod))
    with trio.fail_after(TIMEOUT * 3):
        async with node.running() as old:
            await kubelet.wait_until(lambda k: registered_sockets() == [old_socket])
            while not any(s["spec"]["pool"]["name"] == pool for s in api.slices.values()):
                await api.changed.wait_touched()
            before = gp.dra_device_name("gopher0")
            api.put_claim(allocated_claim("before", "uid-before", pool, before))
            first = (await kubelet.prepare(DRIVER, [("default", "uid-before", "before")])).claims["uid-before"]
            assert first.error == ""
            async with node.running(new_pod) as new:
                await kubelet.wait_until(lambda k: registered_sockets() == [old_socket, new_socket])
                device = gp.dra_device_name("gopher1")
                during = allocated_claim("during", "uid-during", pool, device)
                api.put_claim(during)
                prepared = (await kubelet.prepare(DRIVER, [("default", "uid-during", "during")])).claims["uid-during"]
                assert prepared.error == ""
                ids = kubelet.cdi_devices("uid-during", "gopher")
                pod = Pod(tier, "dra-consumer-during-update")
                config = consumer_config(pod, CDI_devices=[rs.PB.CDIDevice(name=i) for i in ids])
                async with running_pod(tier.containerd, pod, pod.sandbox_config(), [config]):
                    seen = await consumer_report(
                        tier.containerd, pod.container_ids["consumer"], str(path.with_name("gopher1"))
                    )
                kubelet.wiping_delay = 0  # were the driver left without a plugin, its slices would go at once
                await node.stop_now(old)  # the controller deletes the old pod once the new one is ready
                await kubelet.wait_until(lambda k: registered_sockets() == [new_socket])
                gone = await kubelet.unprepare(
                    DRIVER, [("default", "uid-before", "before"), ("default", "uid-during", "during")]
                )
                code, said = await liveness_probe(node, new_pod)  # the new pod's own port
                full, full_said = await exec_sync(tier.containerd, new, "gopherplug", "probe", timeout=10)
                left = sorted(os.listdir(registry))
                events = list(kubelet.events)  # the new pod still serving: its own stop is not the update's
                (old_log,) = (node.pod.dir / "logs").glob("*/0.log")  # the old pod's, as the runtime kept it
                (stored,) = [s for s in api.slices.values() if s["spec"]["pool"]["name"] == pool]
    tier.outputs["DRA rolling update: ResourceSlice devices as stored"] = stored["spec"]["devices"]
    tier.outputs["DRA rolling update: allocation used"] = during["status"]["allocation"]
    tier.outputs["DRA rolling update: registrations"] = [(e, os.path.basename(p)) for e, p in events]
    tier.outputs["DRA rolling update: consumer"] = seen
    tier.outputs["DRA rolling update: new pod's liveness probe"] = f"{code} {said.strip()}"
    assert ids == [i for d in prepared.devices for i in d.cdi_device_ids] != []
    assert seen["ls exit"] == 0 and " 10, 229 " in seen["ls -l"]
    assert (seen["open exit"], seen["open rw"]) == (0, "opened rw")
    assert any(line.endswith("=gopher1") for line in seen["env"]), seen["env"]
    assert [(uid, answer.error) for uid, answer in sorted(gone.claims.items())] == [
        ("uid-before", ""),
        ("uid-during", ""),
    ]
    assert code == 200, said
    assert full == 0, full_said
    assert left == [new_socket]  # the old pod removed its own socket, not the new one's
    # The kubelet's view, event by event: from the first registration on, never no plugin of the driver.
    count, seen_one = 0, False
    for event, _ in events:
        if event in ("registered", "deregistered"):
            count += 1 if event == "registered" else -1
            seen_one |= count > 0
            assert not (seen_one and count == 0), events
    assert seen_one and ("deregistered", str(registry_seen / old_socket)) in events
    assert ("wiped", DRIVER) not in events
    # The old pod left the slices to the new one once it saw it (both write them otherwise).
    said_old = [line for line in old_log.read_text().splitlines() if "the slices are left to it" in line]
    tier.outputs["DRA rolling update: the old pod's log"] = said_old
    assert len(said_old) == 1 and f"/var/lib/kubelet/plugins_registry/{new_socket}" in said_old[0], old_log.read_text()


########################################################################################################
# Moving a node from the device plugin to DRA: the same pod spec, served by each in turn


def _limits_pod(name: str) -> dict[str, Any]:
    """The pod spec a user wrote for the device plugin: one container, example.com/gopher: 1 in limits."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "uid": str(uuid.uuid4())},
        "spec": {
            "containers": [{"name": "consumer", "image": BUSYBOX_IMAGE, "resources": {"limits": {RESOURCE: "1"}}}]
        },
    }


async def test_the_same_limits_pod_gets_the_device_from_the_device_plugin_then_from_dra_after_the_switch(
    tier, nursery, monkeypatch
):
    """Migration without touching pods. A pod spec with example.com/gopher: 1 in resources.limits is
    placed by the scheduler stand-in on a node that runs daemonset.yaml's pod: the node's allocatable
    has the name, so the device plugin serves it, and the consumer created with the Allocate answer
    opens the node. The node is then switched as the DaemonSets' node affinity does when it is
    labelled gopherplug.example.com/api=dra: the device-plugin pod stopped (the kubelet reports 0
    allocatable at once), daemonset-dra.yaml's pod started. The same spec is now placed through the
    shipped DeviceClass's extendedResourceName: a claim allocated from the slice the DRA pod published,
    prepared by the DRA pod, and the consumer created with the CDI devices of its mapped request opens
    the same node through containerd's CDI."""
    plugin_node = Node(tier, "daemonset.yaml", "switch")
    dra_node = Node(tier, "daemonset-dra.yaml", "switch")  # the same node: its kubelet dir and devices
    path = plugin_node.mknod("gopher0")
    for node in (plugin_node, dra_node):
        # The pods share the host's network here, and other tests (or runs) may hold the metrics
        # ports; metrics are not what this test is about.
        del node.config["metrics_address"]
    api, host_side = await _api_server_for(dra_node, nursery, monkeypatch)
    scheduler = standins.SchedulerSimulator(api, [_shipped_device_class()])
    kubelet = await nursery.start(gp.KubeletSimulator(str(plugin_node.device_plugin_dir)).run)
    dra_kubelet = standins.DraKubeletSimulator(str(host_side), wipe=lambda d: api.delete_node_slices(NODE_NAME, d))
    await nursery.start(dra_kubelet.run)
    node_uid = str(uuid.uuid4())

    def node_status() -> None:  # the kubelet's node status update: the device plugins' allocatable
        api.put_node(NODE_NAME, node_uid, allocatable={"cpu": "2", **kubelet.allocatable()})

    with trio.fail_after(TIMEOUT):
        async with plugin_node.running():
            await kubelet.wait_until(lambda k: kubelet_lists(k, "gopher0"))
            node_status()
            first = _limits_pod("before")
            placed = scheduler.schedule(first, NODE_NAME)
            assert (placed.device_plugin, placed.claim) == ({RESOURCE: 1}, None)
            answer = (await kubelet.allocate(RESOURCE, ["gopher0"])).container_responses[0]
            pod = Pod(tier, "limits-device-plugin")
            config = consumer_config(pod, **allocated_fields(answer))
            config.mounts.extend(allocated_mounts(answer))
            async with running_pod(tier.containerd, pod, pod.sandbox_config(), [config]):
                by_device_plugin = await consumer_report(tier.containerd, pod.container_ids["consumer"], str(path))
        # The switch: the device-plugin pod is gone (stopped above), and the device manager marks its
        # devices unhealthy at once; the Node still says 1 until the kubelet's next status update
        # (every 10 s). The DRA pod, started meanwhile, holds the resource back: no slice while the
        # Node counts it, so no claim can get the device the device plugin may have given.
        await kubelet.wait_until(lambda k: k.allocatable() == {RESOURCE: "0"})
        assert api.nodes[NODE_NAME]["status"]["allocatable"][RESOURCE] == "1"
        async with dra_node.running():
            await dra_kubelet.wait_until(lambda k: DRIVER in k.drivers)
            # The driver lists its Node (it still counts 1: the resource is held back), then
            # watches it: the next node status update reaches it through the watch.
            while api.count("watch", "nodes") < 1:
                await api.changed.wait_touched()
            pool = gp.dra_pool_name(NODE_NAME, RESOURCE)
            held = [s for s in api.slices.values() if s["spec"]["pool"]["name"] == pool]
            node_status()  # now 0
            while not any(s["spec"]["pool"]["name"] == pool and s["spec"]["devices"] for s in api.slices.values()):
                await api.changed.wait_touched()
            (published,) = [s for s in api.slices.values() if s["spec"]["pool"]["name"] == pool]
            second = _limits_pod("after")
            assert second["spec"]["containers"] == first["spec"]["containers"]  # the same spec
            placed = scheduler.schedule(second, NODE_NAME)
            assert placed.device_plugin == {} and placed.claim is not None
            await dra_kubelet.prepare_extended_resources(second, placed.claim)
            ids = dra_kubelet.extended_resource_cdi_devices(second, placed.claim, "consumer")
            pod = Pod(tier, "limits-dra")
            config = consumer_config(pod, CDI_devices=[rs.PB.CDIDevice(name=i) for i in ids])
            async with running_pod(tier.containerd, pod, pod.sandbox_config(), [config]):
                by_dra = await consumer_report(tier.containerd, pod.container_ids["consumer"], str(path))
            # The plugin's log as `kubectl logs` shows it (the runtime's file of its stderr).
            dra_log = (dra_node.pod.dir / "logs" / "gopherplug" / "0.log").read_text()
    warned = [line.split(" ", 3)[3] for line in dra_log.splitlines() if "held back" in line or "is 0 now" in line]
    tier.outputs["switch: the DRA pod's log while the Node still counted the device plugin's"] = warned
    assert held == [] and len(warned) == 2, dra_log
    assert "example.com/gopher: node tier-node's allocatable still has 1 of it" in warned[0]
    assert "example.com/gopher: node tier-node's allocatable for it is 0 now" in warned[1]
    tier.outputs["switch: ResourceSlice device as stored"] = published["spec"]["devices"]
    tier.outputs["switch: claim allocation"] = placed.claim["status"]["allocation"]
    tier.outputs["switch: pod extendedResourceClaimStatus"] = second["status"]["extendedResourceClaimStatus"]
    tier.outputs["switch: CDI device IDs"] = ids
    tier.outputs["switch: consumer served by the device plugin"] = by_device_plugin
    tier.outputs["switch: consumer served by DRA"] = by_dra
    assert "GOPHER_DEVICES=gopher0" in by_device_plugin["env"]
    assert by_device_plugin["ls -l"].startswith("crw") and " 10, 229 " in by_device_plugin["ls -l"]
    assert (by_device_plugin["open exit"], by_device_plugin["open rw"]) == (0, "opened rw")
    assert any(line.startswith("GOPHER_DEVICES_") and line.endswith("=gopher0") for line in by_dra["env"]), by_dra
    assert "GOPHER_DEVICES=gopher0" in by_dra["env"], by_dra  # the env the device plugin gave, through DRA
    assert by_dra["ls -l"].startswith("crw") and " 10, 229 " in by_dra["ls -l"]
    assert (by_dra["open exit"], by_dra["open rw"]) == (0, "opened rw")


########################################################################################################
# NVIDIA GPUs: examples/nvidia's configuration in the shipped pod, fake nodes with the driver's numbers

#: The nodes of a node with NVIDIA GPUs, with the numbers its driver gives them (major 195 for the
#: GPUs and nvidiactl, nvidia-uvm's dynamic one as recorded on a real node: 238). Nothing here
#: drives them: opening one the device rules allow fails with ENXIO, one they refuse with EPERM.
NVIDIA_NODES = {
    "nvidia0": (195, 0),
    "nvidia1": (195, 1),
    "nvidia2": (195, 2),
    "nvidiactl": (195, 255),
    "nvidia-uvm": (238, 0),
    "nvidia-uvm-tools": (238, 1),
}
NVIDIA_EXAMPLE = HERE / "examples" / "nvidia"


def nvidia_node(tier: Run, config_name: str, manifest: str) -> Node:
    """A Node whose devices are NVIDIA_NODES (three GPUs) and whose ConfigMap holds the example's
    resource, /dev in its paths standing for the run's directory of /dev."""
    node = Node(tier, manifest)
    for name, (major, minor) in NVIDIA_NODES.items():
        os.mknod(node.devices / name, 0o666 | stat.S_IFCHR, os.makedev(major, minor))
        os.chmod(node.devices / name, 0o666)  # crw-rw-rw- as the driver makes them, whatever the umask
    (resource,) = yaml.safe_load((NVIDIA_EXAMPLE / config_name).read_text())["resources"]
    resource["directory"] = str(node.devices)
    for spec in resource["device_specs"]:
        spec["host_path"] = spec["host_path"].replace("/dev/", f"{node.devices}/", 1)
    # The plugin's image has neither nvidia-smi nor the script (test_examples.py runs describe
    # with a fake nvidia-smi): without it here, the tier shows the nodes and the env.
    del resource["describe"]
    node.config["resources"] = [resource]
    return node


async def nvidia_consumer_report(containerd: Containerd, container_id: str) -> dict[str, Any]:
    """What a consumer sees of the NVIDIA nodes: its env, `ls -l` of each, what opening each says
    but nvidia2 (ENXIO: the device rules let it through to a driver that is not there), the same
    for nvidia2, which it was not given, made inside with mknod; and the major 195 and 238 rules of
    its cgroup."""
    _, env = await exec_sync(containerd, container_id, "env")
    listed, opened = {}, {}
    for name in NVIDIA_NODES:
        _, listed[name] = await exec_sync(containerd, container_id, "ls", "-l", f"/dev/{name}")
        if name != "nvidia2":  # (not there: the shell would create a file by that name)
            command = f"exec 3<>/dev/{name} && echo opened"
            _, opened[name] = await exec_sync(containerd, container_id, "sh", "-c", command)
    _, refused = await exec_sync(
        containerd, container_id, "sh", "-c", "mknod /tmp/nvidia2 c 195 2 && exec 3<>/tmp/nvidia2 && echo opened"
    )
    rules = await device_rules(containerd, container_id)
    return {
        "env": sorted(line for line in env.splitlines() if line.startswith("NVIDIA_")),
        "ls -l": {name: said.strip() for name, said in listed.items()},
        "open rw": {name: said.strip() for name, said in opened.items()},
        "nvidia2 made inside, open rw": refused.strip(),
        "device rules (host side)": [rule for rule in rules["rules"] if rule.startswith(("c 195:", "c 238:"))],
    }


def assert_given_two_gpus(seen: dict[str, Any]) -> None:
    """The consumer of GPUs 0 and 1: their nodes and the three shared ones in its /dev, with the
    host's numbers, and in its device rules; nvidia2 neither, and refused when made inside."""
    given = ["nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"]
    for name in given:
        major, minor = NVIDIA_NODES[name]
        assert re.match(rf"crw-rw-rw- +1 0 +0 +{major}, +{minor} .* /dev/{name}$", seen["ls -l"][name]), seen
        # Past the device rules (EPERM), to the kernel's lookup of the driver: no such device.
        assert seen["open rw"][name].endswith("No such device or address"), seen
    assert seen["ls -l"]["nvidia2"].endswith("No such file or directory"), seen
    assert seen["nvidia2 made inside, open rw"].endswith("Operation not permitted"), seen
    rules = seen["device rules (host side)"]
    assert sorted(rules) == sorted(f"c {NVIDIA_NODES[name][0]}:{NVIDIA_NODES[name][1]} rw" for name in given), seen


async def test_nvidia_gpus_reach_a_consumer_with_the_shared_nodes_and_the_joined_env(tier, nursery):
    """examples/nvidia/config.yaml in daemonset.yaml's pod, on a node of three GPUs: the kubelet
    stand-in is offered 0, 1 and 2, and a consumer created with Allocate's answer for 0 and 1 finds
    /dev/nvidia0, /dev/nvidia1, nvidiactl, nvidia-uvm and nvidia-uvm-tools in its /dev and its device
    cgroup (not nvidia2), and NVIDIA_VISIBLE_DEVICES=0,1 in its environment."""
    node = nvidia_node(tier, "config.yaml", "daemonset.yaml")
    kubelet = await nursery.start(gp.KubeletSimulator(str(node.device_plugin_dir)).run)

    def listed(k: gp.KubeletSimulator) -> bool:
        resource = k.resources.get("nvidia.com/gpu")
        return resource is not None and resource.streaming and len(resource.devices) == 3

    with trio.fail_after(TIMEOUT):
        async with node.running():
            await kubelet.wait_until(listed)
            assert kubelet.resources["nvidia.com/gpu"].devices == dict.fromkeys(["0", "1", "2"], gp.HEALTHY)
            answer = (await kubelet.allocate("nvidia.com/gpu", ["0", "1"])).container_responses[0]
            pod = Pod(tier, "gpu-consumer")
            config = consumer_config(pod, **allocated_fields(answer))
            async with running_pod(tier.containerd, pod, pod.sandbox_config(), [config]):
                seen = await nvidia_consumer_report(tier.containerd, pod.container_ids["consumer"])
    tier.outputs["nvidia (device plugin): consumer of GPUs 0 and 1"] = seen
    assert seen["env"] == ["NVIDIA_VISIBLE_DEVICES=0,1"]
    assert_given_two_gpus(seen)


async def test_nvidia_gpus_reach_a_dra_consumer_through_the_claims_cdi_devices(tier, nursery, monkeypatch):
    """examples/nvidia/config-dra.yaml in daemonset-dra.yaml's pod, on a node of three GPUs: the
    slice offers 0, 1 and 2; a claim allocated 0 and 1, prepared, gives a consumer created with its
    CDI device IDs alone (as the kubelet passes them) the two GPUs' nodes and the three shared ones,
    through containerd's CDI handling, and not nvidia2; and NVIDIA_VISIBLE_DEVICES=0,1, the string
    the device plugin's Allocate gives (beside each device's NVIDIA_VISIBLE_DEVICES_<N>)."""
    node = nvidia_node(tier, "config-dra.yaml", "daemonset-dra.yaml")
    api, kubelet = await dra_cluster(node, nursery, monkeypatch)
    pool = gp.dra_pool_name(NODE_NAME, "nvidia.com/gpu")
    with trio.fail_after(TIMEOUT):
        async with node.running():
            devices = await stored_devices(api, pool, lambda devices: len(devices) == 3)
            assert sorted(devices) == ["0", "1", "2"]
            await kubelet.wait_until(lambda k: DRIVER in k.drivers)
            results = [{"request": "gpus", "driver": DRIVER, "pool": pool, "device": name} for name in ("0", "1")]
            made = dra_claim("gpus", [{"name": "gpus", "exactly": {"deviceClassName": "gpu.nvidia.com"}}], results)
            api.put_claim(made)
            uid = made["metadata"]["uid"]
            prepared = (await kubelet.prepare(DRIVER, [("default", uid, "gpus")])).claims[uid]
            assert prepared.error == ""
            ids = kubelet.cdi_devices(uid, "gpus")
            pod = Pod(tier, "gpu-dra-consumer")
            config = consumer_config(pod, CDI_devices=[rs.PB.CDIDevice(name=i) for i in ids])
            async with running_pod(tier.containerd, pod, pod.sandbox_config(), [config]):
                seen = await nvidia_consumer_report(tier.containerd, pod.container_ids["consumer"])
    tier.outputs["nvidia (DRA): CDI device IDs"] = ids
    tier.outputs["nvidia (DRA): consumer of GPUs 0 and 1"] = seen
    assert_given_two_gpus(seen)
    assert "NVIDIA_VISIBLE_DEVICES=0,1" in seen["env"], seen["env"]
