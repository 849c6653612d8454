"""The recipes (examples/) and the NVIDIA GPUs' (examples/nvidia)."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import trio
import trio.socket
import trio.testing
import yaml

import gopherplug as gp
import gopherplug_standins as standins
from testsupport import (
    DRIVER,
    HERE,
    NVIDIA,
    NVIDIA_DATA,
    RECIPES,
    TIMEOUT,
    cdi_edits,
    check,
    claim,
    fake_nvidia_node,
    nvidia_gpus,
    read_spec,
    run_cli,
)

# ------------------------------------------------------------------------------------------------
# Recipes: every examples/ configuration against a tree shaped like a node's /dev
# ------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_recipe_pods_are_valid_against_the_kubernetes_schema():
    pods = sorted(str(path.relative_to(HERE)) for path in (HERE / "examples").glob("*/pod.yaml"))
    assert len(pods) == len(RECIPES) + 1  # and examples/fpga's, whose recipe test_recipes.py runs
    result = check("kubernetes-validate", "--strict", *pods)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("passed") == len(pods)


DRA_RECIPES = ["camera", "fpga", "fuse", "nvidia", "tun"]  # the recipes with a DRA pod-dra.yaml


SHARED_DRA_RECIPES = ["fuse", "tun"]  # those of one device shared by many claims (replicas)


@pytest.mark.slow
def test_dra_recipes_are_valid_against_the_kubernetes_schema():
    """Each DRA recipe's DeviceClass, ResourceClaimTemplate and Deployment, in the versions that
    serve resource.k8s.io/v1."""
    recipes = sorted(str(path.relative_to(HERE)) for path in (HERE / "examples").glob("*/pod-dra.yaml"))
    assert recipes == [f"examples/{example}/pod-dra.yaml" for example in DRA_RECIPES]
    for version in ("1.34.0", "1.37.0"):
        result = check("kubernetes-validate", "--strict", "-k", version, *recipes)
        assert result.returncode == 0, result.stdout + result.stderr
        assert result.stdout.count("passed") == 3 * len(recipes)


@pytest.mark.slow
@pytest.mark.parametrize("example", SHARED_DRA_RECIPES)
async def test_dra_recipe_shares_its_one_device_among_the_deployments_pods(example, dra_node):
    """The DRA variant of a shared-device recipe, on a tree shaped like a node's /dev: its one node
    is published shared by ``replicas`` claims; the Deployment's pods each get a claim made from the
    template, which the scheduler stand-in allocates from the slice with the recipe's DeviceClass (a
    share each of the one device, a shareID each), and each is prepared with a CDI device of its
    own whose node is the one node. The device then takes claims up to ``replicas``, and no more."""
    make_tree, _, _, specs = RECIPES[example]
    dev = dra_node.root / "dev"
    make_tree(str(dev), str(dra_node.root / "sys"))
    config = yaml.safe_load((HERE / "examples" / example / "config-dra.yaml").read_text())
    (resource,) = config["resources"]
    resource["directory"] = str(dev) + resource["directory"].removeprefix("/dev")
    resource["cdi"] = {"kind": f"{DRIVER}/{example}", "spec_dir": dra_node.cdi["spec_dir"]}  # the default kind
    config["dra"]["kubelet_dir"] = str(dra_node.kubelet_dir)
    config.update(device_plugin_dir=str(dra_node.root / "dp"), dev_root=str(dev))
    parsed = gp.parse_config(yaml.safe_dump(config), f"examples/{example}/config-dra.yaml")
    docs = {doc["kind"]: doc for doc in yaml.safe_load_all((HERE / "examples" / example / "pod-dra.yaml").read_text())}
    pods = docs["Deployment"]["spec"]["replicas"]
    (template_claim,) = docs["Deployment"]["spec"]["template"]["spec"]["resourceClaims"]
    assert template_claim["resourceClaimTemplateName"] == docs["ResourceClaimTemplate"]["metadata"]["name"]
    (request,) = docs["ResourceClaimTemplate"]["spec"]["spec"]["devices"]["requests"]
    scheduler = standins.SchedulerSimulator(dra_node.api, [docs["DeviceClass"]])
    pool = gp.dra_pool_name("node-1", resource["name"])

    def claim_from_template(number):
        """The claim the resource claim controller makes for a pod from the template (its spec)."""
        made = claim(f"{example}-{number}", f"uid-{number}")
        made["spec"] = copy.deepcopy(docs["ResourceClaimTemplate"]["spec"]["spec"])
        return made

    def scheduled(made):
        made["status"] = {"allocation": scheduler.allocate(made, "node-1")}
        dra_node.api.put_claim(made)
        return made

    with trio.fail_after(TIMEOUT):
        await dra_node.start(parsed)
        await dra_node.registered()
        await dra_node.wait_for_slices([example], pool=pool)
        (published,) = [d for s in dra_node.api.slices.values() for d in s["spec"]["devices"]]
        claims = [scheduled(claim_from_template(n)) for n in range(pods)]
        results = [c["status"]["allocation"]["devices"]["results"] for c in claims]
        assert all(len(r) == 1 for r in results)
        shares = [result["shareID"] for [result] in results]
        assert len(set(shares)) == pods  # one device, a share of its own for each claim
        assert {(r["request"], r["pool"], r["device"]) for [r] in results} == {
            (request["name"], pool, published["name"])
        }
        assert [r["consumedCapacity"] for [r] in results] == [{"shares": "1"}] * pods  # the policy's default
        answer = await dra_node.kubelet.prepare(
            DRIVER, [("default", c["metadata"]["uid"], c["metadata"]["name"]) for c in claims]
        )
    uids = [c["metadata"]["uid"] for c in claims]
    assert all(not answer.claims[uid].error for uid in uids)
    names = [dra_node.kubelet.cdi_devices(uid, request["name"]) for uid in uids]
    # Each claim's share, its request's env, and its device metadata's mount (dra.device_metadata is
    # on by default).
    assert names == [
        [
            f"{DRIVER}/{example}={example}-{share}",
            f"{DRIVER}/{example}={uid}_{request['name']}",
            f"{DRIVER}/metadata={uid}_{request['name']}",
        ]
        for uid, share in zip(uids, shares, strict=True)
    ]
    for uid, share in zip(uids, shares, strict=True):
        env, described = read_spec(Path(dra_node.cdi["spec_dir"]) / f"{DRIVER}-{example}_{uid}.json")["devices"]
        assert (env["name"], described["name"]) == (f"{uid}_{request['name']}", f"{example}-{share}")
        [node] = described["containerEdits"]["deviceNodes"]
        assert node["hostPath"] == str(dev) + specs[0][0].removeprefix("/dev")
    # The device takes claims up to the recipe's replicas; the one after them is unschedulable.
    for number in range(pods, resource["replicas"]):
        scheduled(claim_from_template(number))
    with pytest.raises(standins.UnschedulableError, match=r"^cannot allocate all claims$"):
        scheduler.allocate(claim_from_template(resource["replicas"]), "node-1")


# ------------------------------------------------------------------------------------------------
# NVIDIA GPUs (examples/nvidia): the describe script on a recorded H200, the configs on a fake node
# ------------------------------------------------------------------------------------------------


#: A fake nvidia-smi answering --query-gpu from a recording (an H200's, unless NVIDIA_SMI_RECORDING).
FAKE_NVIDIA_SMI = NVIDIA_DATA / "nvidia-smi"


H200_JSON = {
    "0": {
        "attributes": {
            "index": 0,  # nvidia-smi's
            "productName": "NVIDIA H200",
            "uuid": "GPU-e2172bd0-b207-9571-7f11-fabf67b4308c",
            "driverVersion": {"version": "580.159.4"},
            "computeCapability": {"version": "9.0.0"},
            "resource.kubernetes.io/pciBusID": "0000:00:06.0",
            # On bus 00 of domain 0000: on the root bus pci0000:00. Its numa_node was -1: no numaNode.
            "resource.kubernetes.io/pcieRoot": "pci0000:00",
        },
        "capacity": {"memory": "143771Mi"},
    }
}


def nvidia_sysfs(proc):
    """The fake node's sysfs, beside its proc (fake_nvidia_node)."""
    return Path(proc).parents[2] / "sys"


def nvidia_describe(proc, recording, *options):
    """examples/nvidia/nvidia-describe.py, run as gopherplug runs it, with the fake nvidia-smi."""
    script = [sys.executable, str(NVIDIA / "nvidia-describe.py"), "--sysfs", str(nvidia_sysfs(proc))]
    return subprocess.run(
        [*script, "--nvidia-smi", str(FAKE_NVIDIA_SMI), "--proc", str(proc), *options],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env={**os.environ, "NVIDIA_SMI_RECORDING": str(recording)},
        check=False,
    )


@pytest.mark.slow
def test_the_fake_nvidia_smi_answers_as_the_recorded_h200_did():
    """The fake's answer to describe's query is what the real nvidia-smi printed on the H200 for it
    (recorded separately, with noheader and nounits); it refuses what the real one refuses."""
    query = ["--query-gpu=index,uuid,name,memory.total,pci.bus_id,driver_version,compute_cap"]
    answered = subprocess.run(
        [str(FAKE_NVIDIA_SMI), *query, "--format=csv,noheader,nounits"], capture_output=True, text=True, check=False
    )
    recorded = (NVIDIA_DATA / "h200-query-gpu-noheader-nounits.csv").read_text()
    assert (answered.returncode, answered.stdout) == (0, recorded)
    usage = "Invalid combination of input arguments. Please run 'nvidia-smi -h' for help."
    for argv, said in [
        ([*query, "--format=csv", "--bogus"], usage),
        (["--query-gpu=index,clocks.sm", "--format=csv"], 'Field "clocks.sm" is not a valid field to query.'),
        (query, usage),  # no --format
    ]:
        refused = subprocess.run([str(FAKE_NVIDIA_SMI), *argv], capture_output=True, text=True, check=False)
        assert (refused.returncode, refused.stdout) == (2, said + "\n")


@pytest.mark.slow
def test_nvidia_describe_turns_the_recorded_h200_into_attributes_and_capacity(tmp_path):
    """The recorded H200: its product name and UUID as they are, the driver's 580.159.04 and compute
    capability 9.0 as semantic versions (580.159.4, 9.0.0), the PCI address as sysfs spells it (a
    4-digit domain, where nvidia-smi prints 8), the memory in Mi; keyed by its node's number."""
    _, proc, recording = fake_nvidia_node(tmp_path, count=1)
    described = nvidia_describe(proc, recording)
    assert (described.returncode, described.stderr) == (0, "")
    assert json.loads(described.stdout) == H200_JSON


@pytest.mark.slow
def test_nvidia_describe_keys_each_gpu_by_its_node_and_leaves_out_what_nvidia_smi_does_not_know(tmp_path):
    """Three GPUs whose node numbers are not nvidia-smi's indices (the driver's probe order): each is
    described under its node's number, found through its PCI address. A value nvidia-smi does not
    know ([N/A], [Not Supported]) is left out, never made up; a GPU the driver lists no node for is
    left out, with a line saying so, as is one whose indices and minors differ. The NUMA node is
    its PCI function's, where sysfs has one (not -1)."""
    _, gpus = nvidia_gpus(3, minors=[2, 0, 1])
    rows = [row for row, _, _ in gpus]
    values = rows[2].split(", ")
    values[3], values[5], values[6] = "[N/A]", "[Not Supported]", "N/A"  # memory, driver, compute capability
    upper = rows[1].replace("00000000:00:07.0", "00000000:00:0A.0")  # an address the driver has no node for
    rows = [rows[0], upper, ", ".join(values)]
    _, proc, recording = fake_nvidia_node(tmp_path, minors=[2, 0, 1], rows=rows, numa_nodes=[-1, 0, 1])
    described = nvidia_describe(proc, recording)
    assert described.returncode == 0, described.stderr
    devices = json.loads(described.stdout)
    assert sorted(devices) == ["1", "2"]
    assert devices["2"] == H200_JSON["0"]  # nvidia-smi's GPU 0, the recorded one, is /dev/nvidia2
    assert devices["1"] == {
        "attributes": {
            "index": 2,
            "productName": "NVIDIA H200",
            "uuid": "GPU-e2172bd0-b207-9571-7f11-fabf67b43002",
            "resource.kubernetes.io/pciBusID": "0000:00:08.0",
            "resource.kubernetes.io/pcieRoot": "pci0000:00",
            "resource.kubernetes.io/numaNode": 1,  # its PCI function's numa_node
        },
        "capacity": {},
    }
    assert described.stderr.splitlines() == [
        "nvidia-describe: /dev/nvidia2 is nvidia-smi's GPU 0: indices and minors differ on this node",
        "nvidia-describe: left out GPU 1 (PCI 00000000:00:0A.0): the driver lists no node for it",
        "nvidia-describe: /dev/nvidia1 is nvidia-smi's GPU 2: indices and minors differ on this node",
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    "case, said",
    [
        ("no driver", "nvidia-smi exited 9: NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA"),
        ("no /proc", "gpus: No such file or directory: the nvidia driver is not loaded, or this is not the host's"),
        ("no nvidia-smi", "nvidia-smi: not found: this container needs nvidia-smi (and libnvidia-ml) from the driver"),
    ],
)
def test_nvidia_describe_that_cannot_describe_says_why_in_one_line(tmp_path, case, said):
    """Exit 1 and one line on stderr, the one gopherplug's log then shows; nothing on stdout."""
    _, proc, recording = fake_nvidia_node(tmp_path, count=1)
    options = []
    if case == "no driver":
        recording = tmp_path / "none.csv"  # the fake then answers as the real one does without a driver
    elif case == "no /proc":
        proc = tmp_path / "elsewhere"
    else:
        options = ["--nvidia-smi", str(tmp_path / "nvidia-smi")]
    described = nvidia_describe(proc, recording, *options)
    assert (described.returncode, described.stdout) == (1, "")
    [line] = described.stderr.splitlines()
    assert line.startswith("nvidia-describe: ") and said in line, line


def nvidia_example_config(name, dev, proc, **top):
    """An examples/nvidia configuration with /dev standing for the fake node's ``dev``: its
    directory and the host paths of its device_specs (the container paths stay /dev's); its
    describe the example's script with the fake nvidia-smi and the fake node's ``proc``."""
    config = yaml.safe_load((NVIDIA / name).read_text())
    for resource in config["resources"]:
        assert resource["describe"][1:] == ["/opt/gopherplug/nvidia-describe.py"]
        resource["describe"] = [sys.executable, str(NVIDIA / "nvidia-describe.py")]
        resource["describe"] += ["--nvidia-smi", str(FAKE_NVIDIA_SMI), "--proc", str(proc)]
        resource["describe"] += ["--sysfs", str(nvidia_sysfs(proc))]
        resource["directory"] = str(dev) + resource["directory"].removeprefix("/dev")
        for spec in resource["device_specs"]:
            if spec["host_path"].startswith("/dev/"):
                spec["host_path"] = str(dev) + spec["host_path"].removeprefix("/dev")
        resource["allowed_host_paths"] = ["/dev/null"]  # where mknod was refused, nodes are links to it
    config.update(dev_root=str(dev), **top)
    return config


@pytest.mark.slow
@pytest.mark.parametrize("name", ["config.yaml", "config-dra.yaml"])
def test_nvidia_example_configs_pass_check_config_on_a_fake_gpu_node(tmp_path, name):
    """`check-config --strict` on a node with two GPUs: one device per /dev/nvidia<N>, ID N, and
    not nvidiactl, nvidia-uvm, nvidia-uvm-tools or nvidia-caps; each with the attributes and
    capacity describe gave it (the fake nvidia-smi's); a GPU's container gets its node and the three
    shared ones."""
    dev, proc, recording = fake_nvidia_node(tmp_path)
    config = nvidia_example_config(name, dev, proc, device_plugin_dir=str(tmp_path))
    (tmp_path / "kubelet.sock").touch()  # --strict: the kubelet's directory as serve would find it
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config))
    env = {"NODE_NAME": "node-1", "NVIDIA_SMI_RECORDING": str(recording)}
    result = run_cli("check-config", "--strict", "--config", str(path), env=env)
    assert (result.returncode, result.stderr) == (0, ""), result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[1] == f"nvidia.com/gpu: 2 devices, 2 healthy, from {dev}/nvidia[0-9]*"
    # (" -> /dev/null" after the path where mknod was refused and the nodes are links)
    listed = [line.partition(" -> ")[0].split() for line in lines if re.match(r"  [0-9] ", line)]
    assert [(fields[0], fields[-2], fields[-1]) for fields in listed] == [
        ("0", "Healthy", f"{dev}/nvidia0"),
        ("1", "Healthy", f"{dev}/nvidia1"),
    ]
    described = [line.strip() for line in lines if line.startswith("      ")]
    assert described == [
        line
        for index, address, uuid_ in [(0, "0000:00:06.0", "fabf67b4308c"), (1, "0000:00:07.0", "fabf67b43001")]
        for line in [
            "attributes: computeCapability=9.0.0 (version), driverVersion=580.159.4 (version), "
            f'index={index}, productName="NVIDIA H200", resource.kubernetes.io/pciBusID="{address}", '
            f'resource.kubernetes.io/pcieRoot="pci0000:00", uuid="GPU-e2172bd0-b207-9571-7f11-{uuid_}"',
            "capacity: memory=143771Mi",
        ]
    ]
    given = [line.strip() for line in lines if line.strip().startswith(("device ", "env "))]
    host = os.path.realpath  # a link to /dev/null where mknod was refused
    assert given == [
        f"device /dev/nvidia0 <- {host(dev / 'nvidia0')} rw",
        f"device /dev/nvidiactl <- {host(dev / 'nvidiactl')} rw",
        f"device /dev/nvidia-uvm <- {host(dev / 'nvidia-uvm')} rw",
        f"device /dev/nvidia-uvm-tools <- {host(dev / 'nvidia-uvm-tools')} rw",
        "env NVIDIA_VISIBLE_DEVICES=0",  # the device plugin's Allocate, and a DRA claim's env alike
        *(["env NVIDIA_VISIBLE_DEVICES_0=0"] if name == "config-dra.yaml" else []),
    ]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["config.yaml", "config-dra.yaml"])
def test_demo_config_runs_the_nvidia_example_on_a_fake_gpu_node(sockdir, name):
    """`gopherplug demo --config` on examples/nvidia (its /dev and describe the fake H200 node's): the
    device plugin's Allocate of GPU 0, or under DRA its slice with what describe said, a claim for it
    prepared and the CDI edits: the GPU's node, the three shared ones, NVIDIA_VISIBLE_DEVICES."""
    dev, proc, recording = fake_nvidia_node(Path(sockdir) / "node")
    path = Path(sockdir) / "node" / name
    path.write_text(yaml.safe_dump(nvidia_example_config(name, dev, proc)))
    result = run_cli("demo", "--config", str(path), env={"TMPDIR": sockdir, "NVIDIA_SMI_RECORDING": str(recording)})
    assert (result.returncode, result.stderr) == (0, ""), result.stdout + result.stderr
    said = [line.split(None, 3)[3] for line in result.stdout.splitlines()[1:]]
    assert said[0] == f"nvidia.com/gpu: 2 devices, 2 healthy, from {dev}/nvidia[0-9]*"
    host = os.path.realpath  # a link to /dev/null where mknod was refused
    nodes = [(host(dev / node), f"/dev/{node}") for node in ("nvidia0", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")]
    if name == "config.yaml":
        assert "pod default/demo-pod asks for 1 nvidia.com/gpu: Allocate(0)" in said
        assert [line for line in said if line.startswith(("device ", "env "))] == [
            *(f"device {on_host} -> {inside} (rw)" for on_host, inside in nodes),
            "env NVIDIA_VISIBLE_DEVICES=0",
        ]
    else:
        [described] = [line for line in said if line.startswith("device 0: ")]
        assert described.startswith("device 0: resource=nvidia.com/gpu, id=0, healthy=True, computeCapability=9.0.0")
        assert "productName=NVIDIA H200" in described and described.endswith("memory=143771Mi")
        gpu = "gopherplug.example.com/gpu=0"
        assert [line for line in said if line.startswith(gpu + ":")] == [
            *(f"{gpu}: device {on_host} -> {inside}" for on_host, inside in nodes),
            f"{gpu}: env NVIDIA_VISIBLE_DEVICES_0=0",
        ]
        assert "gopherplug.example.com/gpu=demo-0_device: env NVIDIA_VISIBLE_DEVICES=0" in said
    assert said[-1] == "done: plugin stopped, its sockets removed"
    assert os.listdir(sockdir) == ["node"]


async def test_nvidia_device_plugin_gives_two_gpus_their_nodes_the_shared_ones_once_and_the_joined_env(
    nursery, sockdir, monkeypatch
):
    """examples/nvidia/config.yaml served to the kubelet stand-in on a node with two GPUs: both are
    listed (IDs 0 and 1), and a container given both gets /dev/nvidia0, /dev/nvidia1, nvidiactl,
    nvidia-uvm and nvidia-uvm-tools once each (what CUDA opens), with NVIDIA_VISIBLE_DEVICES=0,1."""
    dev, proc, recording = fake_nvidia_node(Path(sockdir))
    monkeypatch.setenv("NVIDIA_SMI_RECORDING", str(recording))
    plugin_dir = os.path.join(sockdir, "dp")
    os.mkdir(plugin_dir)
    config = nvidia_example_config("config.yaml", dev, proc, device_plugin_dir=plugin_dir)
    parsed = gp.parse_config(yaml.safe_dump(config), "examples/nvidia/config.yaml")
    with trio.fail_after(TIMEOUT):
        simulator = await nursery.start(gp.KubeletSimulator(plugin_dir).run)
        await nursery.start(gp.serve_plugin, parsed)
        await simulator.wait_until(lambda s: "nvidia.com/gpu" in s.resources and s.resources["nvidia.com/gpu"].devices)
        [answer] = (await simulator.allocate("nvidia.com/gpu", ["1", "0"])).container_responses
    assert simulator.resources["nvidia.com/gpu"].devices == {"0": gp.HEALTHY, "1": gp.HEALTHY}
    host = os.path.realpath
    assert [(d.container_path, d.host_path, d.permissions) for d in answer.devices] == [
        ("/dev/nvidia1", host(dev / "nvidia1"), "rw"),
        ("/dev/nvidiactl", host(dev / "nvidiactl"), "rw"),
        ("/dev/nvidia-uvm", host(dev / "nvidia-uvm"), "rw"),
        ("/dev/nvidia-uvm-tools", host(dev / "nvidia-uvm-tools"), "rw"),
        ("/dev/nvidia0", host(dev / "nvidia0"), "rw"),
    ]
    assert dict(answer.envs) == {"NVIDIA_VISIBLE_DEVICES": "1,0"}  # the kubelet's order
    [again] = (await simulator.allocate("nvidia.com/gpu", ["0", "1"])).container_responses
    assert dict(again.envs) == {"NVIDIA_VISIBLE_DEVICES": "0,1"}
    assert {d.container_path for d in again.devices} == {d.container_path for d in answer.devices}


@pytest.mark.slow
async def test_nvidia_dra_claim_of_two_gpus_gets_both_and_the_shared_nodes_through_cdi(dra_node, monkeypatch):
    """examples/nvidia: config-dra.yaml publishes one device per GPU, described from the fake
    nvidia-smi (the recorded H200's values, its memory as capacity); pod-dra.yaml's claim of two with
    at least 80Gi each, allocated by the scheduler stand-in with its DeviceClass and CEL, is prepared
    with CDI devices that give the container both GPUs' nodes and nvidiactl, nvidia-uvm and
    nvidia-uvm-tools, and NVIDIA_VISIBLE_DEVICES=0,1 as the device plugin gives it. The same claim
    asking for more memory than an H200 has is unschedulable."""
    dev, proc, recording = fake_nvidia_node(dra_node.root)
    monkeypatch.setenv("NVIDIA_SMI_RECORDING", str(recording))
    config = nvidia_example_config("config-dra.yaml", dev, proc, device_plugin_dir=str(dra_node.root / "dp"))
    config["resources"][0]["cdi"] = {"kind": f"{DRIVER}/gpu", "spec_dir": dra_node.cdi["spec_dir"]}  # the default kind
    config["dra"]["kubelet_dir"] = str(dra_node.kubelet_dir)
    parsed = gp.parse_config(yaml.safe_dump(config), "examples/nvidia/config-dra.yaml")
    docs = {doc["kind"]: doc for doc in yaml.safe_load_all((NVIDIA / "pod-dra.yaml").read_text())}
    (template_claim,) = docs["Pod"]["spec"]["resourceClaims"]
    assert template_claim["resourceClaimTemplateName"] == docs["ResourceClaimTemplate"]["metadata"]["name"]
    (request,) = docs["ResourceClaimTemplate"]["spec"]["spec"]["devices"]["requests"]
    scheduler = standins.SchedulerSimulator(dra_node.api, [docs["DeviceClass"]])
    pool = gp.dra_pool_name("node-1", "nvidia.com/gpu")
    made = claim("cuda-example-dra-gpus", "uid-gpus")
    made["spec"] = copy.deepcopy(docs["ResourceClaimTemplate"]["spec"]["spec"])
    too_big = copy.deepcopy(made)
    [selector] = too_big["spec"]["devices"]["requests"][0]["exactly"]["selectors"]
    selector["cel"]["expression"] = selector["cel"]["expression"].replace('"80Gi"', '"141Gi"')  # 143771Mi is 140.4Gi

    def described():
        devices = [
            d for s in dra_node.api.slices.values() if s["spec"]["pool"]["name"] == pool for d in s["spec"]["devices"]
        ]
        return len(devices) == 2 and all("productName" in d["attributes"] for d in devices)

    with trio.fail_after(TIMEOUT):
        await dra_node.start(parsed)
        await dra_node.registered()
        await dra_node.wait_for_slices(["0", "1"], pool=pool)
        while not described():
            await dra_node.api.changed.wait_touched()
        published = {d["name"]: d for s in dra_node.api.slices.values() for d in s["spec"]["devices"]}
        with pytest.raises(standins.UnschedulableError, match=r"^cannot allocate all claims$"):
            scheduler.allocate(too_big, "node-1")
        made["status"] = {"allocation": scheduler.allocate(made, "node-1")}
        dra_node.api.put_claim(made)
        answer = await dra_node.kubelet.prepare(DRIVER, [("default", "uid-gpus", made["metadata"]["name"])])
    assert not answer.claims["uid-gpus"].error
    # What a claim selects on, as the slice says it (the API server's form: a type per value).
    assert published["0"]["attributes"] == {
        "resource": {"string": "nvidia.com/gpu"},
        "id": {"string": "0"},
        "healthy": {"bool": True},
        "index": {"int": 0},
        "productName": {"string": "NVIDIA H200"},
        "uuid": {"string": "GPU-e2172bd0-b207-9571-7f11-fabf67b4308c"},
        "driverVersion": {"version": "580.159.4"},
        "computeCapability": {"version": "9.0.0"},
        "resource.kubernetes.io/pciBusID": {"string": "0000:00:06.0"},
        "resource.kubernetes.io/pcieRoot": {"string": "pci0000:00"},
    }
    assert published["0"]["capacity"] == {"memory": {"value": "143771Mi"}}
    assert published["1"]["attributes"]["resource.kubernetes.io/pciBusID"] == {"string": "0000:00:07.0"}
    results = made["status"]["allocation"]["devices"]["results"]
    assert sorted((r["request"], r["pool"], r["device"]) for r in results) == [
        (request["name"], pool, "0"),
        (request["name"], pool, "1"),
    ]
    given = dra_node.kubelet.cdi_devices("uid-gpus", request["name"])
    nodes, _ = cdi_edits(dra_node.cdi["spec_dir"], given)
    # The device plugin's env contract: the IDs of the request's devices, joined, in the claim's order.
    env = standins.cdi_container_env([dra_node.cdi["spec_dir"]], given)
    order = ",".join(r["device"] for r in results)
    assert [line for line in env if line.startswith("NVIDIA_VISIBLE_DEVICES=")] == [f"NVIDIA_VISIBLE_DEVICES={order}"]
    host = os.path.realpath
    assert {path: node["hostPath"] for path, node in nodes.items()} == {
        "/dev/nvidia0": host(dev / "nvidia0"),
        "/dev/nvidia1": host(dev / "nvidia1"),
        "/dev/nvidiactl": host(dev / "nvidiactl"),
        "/dev/nvidia-uvm": host(dev / "nvidia-uvm"),
        "/dev/nvidia-uvm-tools": host(dev / "nvidia-uvm-tools"),
    }
