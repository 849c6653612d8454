"""The recipes of examples/ under both APIs, the FPGA board recipe, and what piloting them taught.

Every recipe that runs under the device plugin (config.yaml) runs under DRA too (config-dra.yaml):
each is served both ways on a tree shaped like a node's /dev (and /sys), and a container given the
same device sees the same nodes at the same paths either way, the camera's one at /dev/video0. The
FPGA recipe (examples/fpga) is five XDMA nodes folded into one board, its firmware version
described from the status file the board's tooling writes, a claim selecting boards by it, and its
reset hook, pre_start, before a container (device plugin) or at NodePrepareResources (DRA).
"""

from __future__ import annotations

import copy
import logging
import os
import sys
from pathlib import Path

import pytest
import trio
import yaml

import gopherplug as gp
import gopherplug_standins as standins
from testsupport import DRIVER, HERE, RECIPES, TIMEOUT, cdi_edits, claim, hailo_config, logged, make_node, run_cli

EXAMPLES = HERE / "examples"
FPGA = EXAMPLES / "fpga"
#: The one recipe folder that is no device recipe: a Prometheus Operator's PodMonitor.
NOT_RECIPES = {"distroless", "embedding", "lesson", "monitoring"}


def fpga_tree(dev, sysfs, versions=(("xdma0", "2.4.1"), ("xdma1", "v2.3.0"))):
    """Two XDMA boards: five nodes each (the driver's dynamic major), the PCI function behind each
    user node in sysfs with its reset file, and the status files the boards' tooling wrote
    (FPGA_STATUS_DIR, beside /dev; a version None: not written yet)."""
    for board in range(len(versions)):
        for minor, node in enumerate(FPGA_NODES):
            make_node(f"{dev}/xdma{board}_{node}", 240, board * 32 + minor)
        # /sys/class/xdma/xdma<N>_user is the driver's class device under the PCI function, and its
        # `device` link leads back up to the function, whose reset file resets it.
        function = Path(sysfs, "devices", "pci0000:00", f"0000:0{3 + board}:00.0")
        (function / "xdma" / f"xdma{board}_user").mkdir(parents=True)
        (function / "reset").write_text("")
        (function / "xdma" / f"xdma{board}_user" / "device").symlink_to("../..")
        Path(sysfs, "class", "xdma").mkdir(parents=True, exist_ok=True)
        Path(sysfs, "class", "xdma", f"xdma{board}_user").symlink_to(function / "xdma" / f"xdma{board}_user")
    status = Path(dev).parent / "run-fpga"
    for board, version in versions:
        (status / board).mkdir(parents=True)
        if version is not None:
            (status / board / "firmware-version").write_text(version + "\n")


FPGA_NODES = ["c2h_0", "control", "events_0", "h2c_0", "user"]  # a board's nodes, in the order a container gets them
#: Each recipe under DRA: what a claim asks for and what its container gets, as (host path, container
#: path) with /dev for the fake root; the device plugin's where a claim gets what Allocate gives.
DRA_CLAIMS = {
    **{example: (ids, specs) for example, (_, _, ids, specs) in RECIPES.items()},
    "fuse": (["fuse"], [("/dev/fuse", "/dev/fuse")]),
    "tun": (["tun"], [("/dev/net/tun", "/dev/net/tun")]),
    # Under DRA a camera is at /dev/video0 in its container, whichever node the host gave it.
    "camera": (["usb-Microsoft_Microsoft_LifeCam_HD-3000-if00-video-index0"], [("/dev/video2", "/dev/video0")]),
    "fpga": (["xdma1"], [(f"/dev/xdma1_{node}", f"/dev/xdma1_{node}") for node in FPGA_NODES]),
}
ALL_RECIPES = {**RECIPES, "fpga": (fpga_tree, ["xdma0", "xdma1"], ["xdma1"], DRA_CLAIMS["fpga"][1])}
#: The recipes whose container paths are the container's own /dev, whatever the host's tree is
#: (templates like /dev/video{index}, /dev/{name}): the others' follow the host paths.
CONTAINER_DEV = {"camera", "nvidia"}


def recipe_config(example, name, dev, sysfs, **top):
    """examples/<example>/<name> with /dev standing for the fake ``dev``, the programs it runs
    (describe, pre_start) the example's own files run by this Python, and ``top`` added."""
    config = yaml.safe_load((EXAMPLES / example / name).read_text())
    for resource in config["resources"]:
        if "directory" in resource:
            resource["directory"] = dev + resource["directory"].removeprefix("/dev")
        for spec in resource.get("device_specs", []):
            if spec["host_path"].startswith("/dev/"):
                spec["host_path"] = dev + spec["host_path"].removeprefix("/dev")
        for key in ("describe", "pre_start"):
            if key in resource:
                resource[key] = [
                    sys.executable if arg == "python3.11" else arg.replace("/opt/gopherplug", str(EXAMPLES / example))
                    for arg in resource[key]
                ]
        resource["allowed_host_paths"] = ["/dev/null"]  # where mknod was refused, nodes are links to it
    config.update(dev_root=dev, sysfs_root=sysfs, **top)
    return config


@pytest.fixture
def fpga_env(monkeypatch, sockdir):
    """Where examples/fpga/xdma-board.py finds the boards' status files and sysfs."""
    monkeypatch.setenv("FPGA_STATUS_DIR", os.path.join(sockdir, "run-fpga"))
    monkeypatch.setenv("FPGA_SYSFS", os.path.join(sockdir, "sys"))


def test_every_recipe_runs_under_both_apis():
    """Each recipe folder has config.yaml and config-dra.yaml, and each is tested both ways here."""
    folders = {path.name for path in EXAMPLES.iterdir() if path.is_dir()} - NOT_RECIPES
    assert folders == set(ALL_RECIPES) == set(DRA_CLAIMS)
    for folder in folders:
        assert (EXAMPLES / folder / "config.yaml").is_file() and (EXAMPLES / folder / "config-dra.yaml").is_file()
        device_plugin = yaml.safe_load((EXAMPLES / folder / "config.yaml").read_text())["resources"]
        dra = yaml.safe_load((EXAMPLES / folder / "config-dra.yaml").read_text())["resources"]
        assert [r["name"] for r in device_plugin] == [r["name"] for r in dra], folder
        assert all(r["api"] == "dra" for r in dra), folder


@pytest.mark.parametrize("example", sorted(ALL_RECIPES))
async def test_recipe_under_the_device_plugin(example, nursery, sockdir, fpga_env):
    make_tree, listed, allocate_ids, specs = ALL_RECIPES[example]
    dev, sysfs = os.path.join(sockdir, "dev"), os.path.join(sockdir, "sys")
    os.makedirs(dev)
    make_tree(dev, sysfs)
    plugin_dir = os.path.join(sockdir, "dp")
    os.mkdir(plugin_dir)
    config = recipe_config(example, "config.yaml", dev, sysfs, device_plugin_dir=plugin_dir)
    parsed = gp.parse_config(yaml.safe_dump(config), f"examples/{example}/config.yaml")
    name = parsed.resources[0].name
    with trio.fail_after(TIMEOUT):
        simulator = await nursery.start(gp.KubeletSimulator(plugin_dir).run)
        await nursery.start(gp.serve_plugin, parsed)
        await simulator.wait_until(lambda s: name in s.resources and s.resources[name].devices)
        answer = (await simulator.allocate(name, allocate_ids)).container_responses[0]
        if parsed.resources[0].pre_start:
            await simulator.pre_start_container(name, allocate_ids)
    assert simulator.resources[name].devices == dict.fromkeys(listed, gp.HEALTHY)
    assert [(d.host_path, d.container_path) for d in answer.devices] == [
        (
            os.path.realpath(dev + host.removeprefix("/dev")),
            container if example in CONTAINER_DEV else dev + container.removeprefix("/dev"),
        )
        for host, container in specs
    ]
    devices = dict.fromkeys(kubelet_id.partition("::")[0] for kubelet_id in allocate_ids)
    assert dict(answer.envs) == {parsed.resources[0].env: ",".join(devices)}
    assert all(d.permissions == "rw" for d in answer.devices)


@pytest.mark.parametrize("example", sorted(ALL_RECIPES))
async def test_recipe_under_dra(example, dra_node, fpga_env):
    """config-dra.yaml on the same tree: every device published in the node's pool, and a claim of
    DRA_CLAIMS' devices prepared with CDI devices that give its container the nodes and the env the
    device plugin's Allocate gives."""
    make_tree, listed, _, _ = ALL_RECIPES[example]
    ids, specs = DRA_CLAIMS[example]
    dev, sysfs = str(dra_node.root / "dev"), str(dra_node.root / "sys")
    os.makedirs(dev)
    make_tree(dev, sysfs)
    config = recipe_config(example, "config-dra.yaml", dev, sysfs, device_plugin_dir=str(dra_node.root / "dp"))
    (resource,) = config["resources"]
    resource["cdi"] = {"kind": f"{DRIVER}/{example}", "spec_dir": dra_node.cdi["spec_dir"]}
    config["dra"]["kubelet_dir"] = str(dra_node.kubelet_dir)
    parsed = gp.parse_config(yaml.safe_dump(config), f"examples/{example}/config-dra.yaml")
    pool = gp.dra_pool_name("node-1", resource["name"])
    names = [gp.dra_device_name(i) for i in ids]
    with trio.fail_after(TIMEOUT):
        await dra_node.start(parsed)
        await dra_node.registered()
        # A shared device (replicas) is one device under DRA, its shares the scheduler's.
        await dra_node.wait_for_slices({gp.dra_device_name(i.partition("::")[0]) for i in listed}, pool=pool)
        dra_node.api.put_claim(claim("c", "uid-c", *[("gopher", DRIVER, pool, n) for n in names]))
        answer = await dra_node.kubelet.prepare(DRIVER, [("default", "uid-c", "c")])
    assert not answer.claims["uid-c"].error
    given = dra_node.kubelet.cdi_devices("uid-c", "gopher")
    nodes, _ = cdi_edits(dra_node.cdi["spec_dir"], given)
    assert {path: node["hostPath"] for path, node in nodes.items()} == {
        (container if example in CONTAINER_DEV else dev + container.removeprefix("/dev")): os.path.realpath(
            dev + host.removeprefix("/dev")
        )
        for host, container in specs
    }
    env = standins.cdi_container_env([dra_node.cdi["spec_dir"]], given)
    assert f"{parsed.resources[0].env}={','.join(ids)}" in env


# ------------------------------------------------------------------------------------------------
# The FPGA board recipe
# ------------------------------------------------------------------------------------------------


def reset_count(sockdir, board):
    """How many resets the board's PCI function was given (each a "1" written to its reset file)."""
    return Path(sockdir, "sys", "class", "xdma", f"{board}_user", "device", "reset").read_text().count("1")


async def test_fpga_device_plugin_folds_five_nodes_and_resets_the_board_before_each_container(
    nursery, sockdir, fpga_env
):
    """examples/fpga/config.yaml: two boards of five nodes each are two devices; Allocate gives a
    container the five nodes of its board; PreStartContainer resets that board (its PCI function's
    reset file written), and refuses the container, in xdma-board.py's one line, while the board's
    firmware status file is not there."""
    dev, sysfs = os.path.join(sockdir, "dev"), os.path.join(sockdir, "sys")
    fpga_tree(dev, sysfs)
    plugin_dir = os.path.join(sockdir, "dp")
    os.mkdir(plugin_dir)
    config = recipe_config("fpga", "config.yaml", dev, sysfs, device_plugin_dir=plugin_dir)
    parsed = gp.parse_config(yaml.safe_dump(config), "examples/fpga/config.yaml")
    status = Path(sockdir, "run-fpga", "xdma1", "firmware-version")
    with trio.fail_after(TIMEOUT):
        simulator = await nursery.start(gp.KubeletSimulator(plugin_dir).run)
        await nursery.start(gp.serve_plugin, parsed)
        await simulator.wait_until(
            lambda s: "example.com/fpga" in s.resources and s.resources["example.com/fpga"].devices
        )
        [answer] = (await simulator.allocate("example.com/fpga", ["xdma1"])).container_responses
        await simulator.pre_start_container("example.com/fpga", ["xdma1"])
        assert (reset_count(sockdir, "xdma0"), reset_count(sockdir, "xdma1")) == (0, 1)
        status.unlink()
        with pytest.raises(gp.RPCError) as refused:
            await simulator.pre_start_container("example.com/fpga", ["xdma1"])
    assert simulator.resources["example.com/fpga"].devices == {"xdma0": gp.HEALTHY, "xdma1": gp.HEALTHY}
    assert [d.container_path for d in answer.devices] == [f"{dev}/xdma1_{node}" for node in FPGA_NODES]
    assert dict(answer.envs) == {"FPGA_DEVICES": "xdma1"}
    assert refused.value.message.endswith(
        f"exited with 1: xdma-board: xdma1: {status} is not written yet (its bitstream is still loading?)"
    )
    assert reset_count(sockdir, "xdma1") == 1


async def test_fpga_dra_publishes_firmware_versions_selects_by_them_and_resets_at_prepare(
    dra_node, sockdir, fpga_env, monkeypatch
):
    """examples/fpga/config-dra.yaml: while a board's status file is not written, describe fails in
    one line saying which, the boards are published without firmwareVersion, and pod-dra.yaml's
    claim (2.4.0 or later, guarded by `in`) is unschedulable rather than a CEL error; describe is
    tried again, and once the file is there both boards carry their version (a leading "v"
    dropped). The claim then gets xdma0 (2.4.1; xdma1 is 2.3.0), prepared with its five nodes after
    xdma-board.py reset it at NodePrepareResources."""
    monkeypatch.setattr(gp, "DESCRIBE_RETRY", (0.05, 0.1))  # the retry's pace, not its existence
    dev, sysfs = str(dra_node.root / "dev"), str(dra_node.root / "sys")
    fpga_tree(dev, sysfs, versions=(("xdma0", "2.4.1"), ("xdma1", None)))
    config = recipe_config("fpga", "config-dra.yaml", dev, sysfs, device_plugin_dir=str(dra_node.root / "dp"))
    config["resources"][0]["cdi"] = {"kind": f"{DRIVER}/fpga", "spec_dir": dra_node.cdi["spec_dir"]}
    config["dra"]["kubelet_dir"] = str(dra_node.kubelet_dir)
    parsed = gp.parse_config(yaml.safe_dump(config), "examples/fpga/config-dra.yaml")
    docs = {doc["kind"]: doc for doc in yaml.safe_load_all((FPGA / "pod-dra.yaml").read_text())}
    scheduler = standins.SchedulerSimulator(dra_node.api, [docs["DeviceClass"]])
    pool = gp.dra_pool_name("node-1", "example.com/fpga")
    made = claim("fpga-example-dra-fpga", "uid-fpga")
    made["spec"] = copy.deepcopy(docs["ResourceClaimTemplate"]["spec"]["spec"])

    def versions():
        devices = [d for s in dra_node.api.slices.values() for d in s["spec"]["devices"]]
        return {d["name"]: d["attributes"].get("firmwareVersion", {}).get("version") for d in devices}

    missing = Path(sockdir, "run-fpga", "xdma1", "firmware-version")
    with trio.fail_after(TIMEOUT), logged("is not written yet") as said:
        await dra_node.start(parsed)
        await dra_node.registered()
        await dra_node.wait_for_slices(["xdma0", "xdma1"], pool=pool)
        await said.wait()
        assert versions() == {"xdma0": None, "xdma1": None}
        with pytest.raises(standins.UnschedulableError, match=r"^cannot allocate all claims$"):
            scheduler.allocate(made, "node-1")
        missing.write_text("v2.3.0\n")
        while versions() != {"xdma0": "2.4.1", "xdma1": "2.3.0"}:
            await dra_node.api.changed.wait_touched()
        made["status"] = {"allocation": scheduler.allocate(made, "node-1")}
        dra_node.api.put_claim(made)
        answer = await dra_node.kubelet.prepare(DRIVER, [("default", "uid-fpga", made["metadata"]["name"])])
    assert f"xdma-board: xdma1: {missing} is not written yet" in said.lines[0]
    assert not answer.claims["uid-fpga"].error
    assert [r["device"] for r in made["status"]["allocation"]["devices"]["results"]] == ["xdma0"]
    nodes, _ = cdi_edits(dra_node.cdi["spec_dir"], dra_node.kubelet.cdi_devices("uid-fpga", "fpga"))
    assert sorted(nodes) == sorted(f"{dev}/xdma0_{node}" for node in FPGA_NODES)
    assert (reset_count(sockdir, "xdma0"), reset_count(sockdir, "xdma1")) == (1, 0)


# ------------------------------------------------------------------------------------------------
# What piloting the boards taught, one test each
# ------------------------------------------------------------------------------------------------


async def test_an_attribute_file_that_appears_after_the_nodes_is_read_again(dra_node, monkeypatch, caplog):
    """An attribute read from a file that is not there yet when the device is found (a board's
    firmware version, which its tooling writes once the bitstream is loaded, outside the directory
    watched): the warning says when it is read again, and it is, without any change to the device,
    until the file is there; the slice then carries the value."""
    monkeypatch.setattr(gp, "VALUES_RETRY", 0.05, raising=False)  # (a module without it never reads again)
    (dra_node.devices / "gopher0").touch()
    version = dra_node.root / "fw-gopher0"
    attributes = {"firmwareVersion": {"file": str(dra_node.root / "fw-{id}"), "type": "version"}}
    caplog.set_level(logging.WARNING)

    def published():
        return [
            d["attributes"].get("firmwareVersion") for s in dra_node.api.slices.values() for d in s["spec"]["devices"]
        ]

    with trio.fail_after(TIMEOUT):
        await dra_node.start(dra_node.config(attributes=attributes))
        await dra_node.wait_for_slices(["gopher0"])
        assert published() == [None]
        version.write_text("1.2.3\n")
        while published() != [{"version": "1.2.3"}]:
            await dra_node.api.changed.wait_touched()
    [warning] = [r.getMessage() for r in caplog.records if "firmwareVersion" in r.getMessage()]
    assert warning == (
        f"example.com/gopher: device gopher0: attributes.firmwareVersion: cannot read {version}: No such file or "
        "directory (read again every 0.05 s until it is)"
    )


async def test_camera_recipe_under_dra_keeps_dev_video0_in_the_container(dra_node):
    """The camera recipe's /dev/video{index} is refused under DRA (a device's CDI edits are written
    before any claim has it); its DRA variant puts each camera at /dev/video0, so a claim of one
    camera, whichever the scheduler chose, sees /dev/video0 as under the device plugin."""
    dev, sysfs = str(dra_node.root / "dev"), str(dra_node.root / "sys")
    RECIPES["camera"][0](dev, sysfs)
    config = recipe_config("camera", "config-dra.yaml", dev, sysfs, device_plugin_dir=str(dra_node.root / "dp"))
    config["resources"][0]["cdi"] = {"kind": f"{DRIVER}/camera", "spec_dir": dra_node.cdi["spec_dir"]}
    config["dra"]["kubelet_dir"] = str(dra_node.kubelet_dir)
    with_index = copy.deepcopy(config)
    with_index["resources"][0]["device_specs"][0]["container_path"] = "/dev/video{index}"
    with pytest.raises(gp.ConfigError, match=r"with cdi, a device is described once"):
        gp.parse_config(yaml.safe_dump(with_index), "config-dra.yaml")
    parsed = gp.parse_config(yaml.safe_dump(config), "examples/camera/config-dra.yaml")
    pool = gp.dra_pool_name("node-1", "example.com/camera")
    uids = {}
    with trio.fail_after(TIMEOUT):
        await dra_node.start(parsed)
        await dra_node.registered()
        await dra_node.wait_for_slices([gp.dra_device_name(i) for i in RECIPES["camera"][1]], pool=pool)
        for number, camera in enumerate(RECIPES["camera"][1]):
            uids[camera] = uid = f"uid-{number}"
            dra_node.api.put_claim(claim(f"c{number}", uid, ("gopher", DRIVER, pool, gp.dra_device_name(camera))))
            answer = await dra_node.kubelet.prepare(DRIVER, [("default", uid, f"c{number}")])
            assert not answer.claims[uid].error
    for camera, host in zip(RECIPES["camera"][1], ["video0", "video2"], strict=True):
        nodes, _ = cdi_edits(dra_node.cdi["spec_dir"], dra_node.kubelet.cdi_devices(uids[camera], "gopher"))
        assert {path: node["hostPath"] for path, node in nodes.items()} == {
            "/dev/video0": os.path.realpath(f"{dev}/{host}")
        }


@pytest.mark.slow
def test_demo_select_applies_each_selector_to_the_resource_it_names(sockdir):
    """`demo --dra --select RESOURCE=CEL`, repeatable: each selector is the claim's of the resource
    it names, and the other resources' claims have none (an FPGA selector no longer fails the
    camera's claim with a CEL error); a bare CEL where the file has two resources, a resource the
    file has not, or one named twice, is refused in one line, exit 2."""
    path = Path(hailo_config(sockdir))
    config = yaml.safe_load(path.read_text())
    os.mkdir(os.path.join(sockdir, "cams"))
    open(os.path.join(sockdir, "cams", "cam0"), "x").close()
    config["resources"].append({"name": "example.com/camera", "directory": os.path.join(sockdir, "cams")})
    path.write_text(yaml.safe_dump(config))
    selector = f'device.attributes["{gp.DEMO_DRIVER}"].firmwareVersion.isGreaterThan(semver("4.17.0"))'
    result = run_cli("demo", "--config", str(path), "--dra", "--select", f"example.com/hailo={selector}")
    assert (result.returncode, result.stderr) == (0, "")
    assert f"selector #0 of claim default/demo-hailo: {selector}" in result.stdout
    assert "allocated a ResourceClaim: device hailo1 of pool demo-node/example.com/hailo" in result.stdout
    assert "allocated a ResourceClaim: device cam0 of pool demo-node/example.com/camera" in result.stdout
    assert "selector #0 of claim default/demo-camera" not in result.stdout
    for argv, said in [
        (
            ["--select", selector],
            "which resource? write RESOURCE=CEL, one of example.com/hailo, example.com/camera",
        ),
        (
            ["--select", "example.com/gpu=true"],
            "example.com/gpu is no resource of the file (example.com/hailo, example.com/camera)",
        ),
        (
            ["--select", "example.com/camera=true", "--select", "example.com/camera=false"],
            "example.com/camera is given twice",
        ),
    ]:
        result = run_cli("demo", "--config", str(path), "--dra", *argv)
        assert (result.returncode, result.stdout, result.stderr) == (2, "", f"gopherplug: --select: {said}\n")


@pytest.mark.slow
async def test_pre_start_under_dra_runs_at_prepare_and_its_failure_refuses_the_claim(dra_node, sockdir):
    """pre_start under DRA: run at NodePrepareResources, once for the claim's devices of the
    resource (their IDs in the env var, as for a container under the device plugin), before any
    CDI device of the claim is written; a non-zero exit refuses the claim with the program's line,
    nothing left behind, and the kubelet's next try runs it again. Past pre_start_timeout it is
    killed, and the claim refused saying so."""
    for name in ("gopher0", "gopher1", "gopher2"):
        (dra_node.devices / name).touch()
    ran = Path(sockdir, "ran")
    script = (
        "import os, sys, time\n"
        f"open({str(ran)!r}, 'a').write(os.environ['GOPHER_DEVICES'] + '\\n')\n"
        "if 'gopher1' in os.environ['GOPHER_DEVICES']: sys.exit('gopher1 is not ready: no bitstream')\n"
        "if 'gopher2' in os.environ['GOPHER_DEVICES']: time.sleep(60)\n"
    )
    config = dra_node.config(pre_start=[sys.executable, "-c", script], pre_start_timeout=1)
    both = ("gopher", DRIVER, dra_node.POOL)
    with trio.fail_after(TIMEOUT):
        await dra_node.start(config)
        await dra_node.registered()
        await dra_node.wait_for_slices(["gopher0", "gopher1", "gopher2"])
        dra_node.api.put_claim(claim("good", "uid-good", (*both, "gopher0")))
        dra_node.api.put_claim(claim("bad", "uid-bad", (*both, "gopher1"), (*both, "gopher0")))
        dra_node.api.put_claim(claim("slow", "uid-slow", (*both, "gopher2")))
        good = await dra_node.kubelet.prepare(DRIVER, [("default", "uid-good", "good")])
        bad = await dra_node.kubelet.prepare(DRIVER, [("default", "uid-bad", "bad")])
        slow = await dra_node.kubelet.prepare(DRIVER, [("default", "uid-slow", "slow")])
    assert not good.claims["uid-good"].error
    assert (
        bad.claims["uid-bad"].error == f"pre_start {sys.executable} exited with 1: gopher1 is not ready: no bitstream"
    )
    assert slow.claims["uid-slow"].error == f"pre_start {sys.executable} did not finish within 1 s (killed)"
    assert ran.read_text().splitlines() == ["gopher0", "gopher1,gopher0", "gopher2"]
    assert not list(Path(dra_node.cdi["spec_dir"]).glob("*uid-bad*"))
