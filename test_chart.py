"""The Helm chart: its renders, checks and values against the plugin's own."""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import traceback

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

import gopherplug as gp
from testsupport import (
    _GOPHER,
    HERE,
    PROPERTIES,
    _gopher,
    check,
    helm_template,
)

# ------------------------------------------------------------------------------------------------
# The Helm chart: the one source of both shipped manifests, linted and rendered by a real helm
# ------------------------------------------------------------------------------------------------


CHART = HERE / "chart" / "gopherplug"


#: Every values file the chart is linted, rendered and validated with (chart-testing's ci/ convention).
CHART_CI_VALUES = sorted(path.name for path in (CHART / "ci").glob("*.yaml"))


#: The shipped manifests: each the chart's render with one of them, under this release name.
SHIPPED_RENDERS = {
    "daemonset.yaml": ("gopherplug", "device-plugin-values.yaml"),
    "daemonset-dra.yaml": ("gopherplug-dra", "dra-values.yaml"),
}


CHART_KUBERNETES_VERSIONS = ("1.34.0", "1.35.0", "1.36.0", "1.37.0")


@pytest.mark.parametrize("manifest", sorted(SHIPPED_RENDERS))
def test_the_shipped_manifests_are_the_charts_renders(helm, manifest):
    """The chart is the one source: each shipped manifest is byte for byte its render with a ci/
    values file, its comments included (what a template cannot say as a YAML comment is a Helm
    comment in the template)."""
    release, values = SHIPPED_RENDERS[manifest]
    result = helm_template(helm, f"chart/gopherplug/ci/{values}", release)
    assert result.returncode == 0, result.stderr
    command = f'"$(.ci/helm)" template {release} chart/gopherplug -n kube-system -f chart/gopherplug/ci/{values}'
    rendered = (HERE / manifest).read_text() == result.stdout
    assert rendered, f"{manifest} is not the chart's render: {command} > {manifest}"


@pytest.mark.slow
def test_the_dra_chart_mounts_only_its_drivers_plugin_directory_and_admits_only_its_slices(helm):
    """The DRA DaemonSet mounted all of <kubeletDir>/plugins read-write, every other
    driver's sockets and the CSI drivers' staged volumes with them. Now plugins/<driver> (the socket,
    the checkpoint, the metadata files) and plugins_registry (the kubelet's plugin watcher) only.
    The admission policy checks a slice's spec.driver beside its spec.nodeName, old and new; no
    NetworkPolicy unless asked for, and then one that lets only the named peers reach the two ports."""
    result = helm_template(helm, "chart/gopherplug/ci/dra-values.yaml", "gopherplug-dra", "--set", "kubeletDir=/k")
    assert result.returncode == 0, result.stderr
    docs = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    kinds = {doc["kind"]: doc for doc in docs}
    assert "NetworkPolicy" not in kinds
    driver = gp.parse_config(kinds["ConfigMap"]["data"]["config.yaml"]).dra.driver
    pod = kinds["DaemonSet"]["spec"]["template"]["spec"]
    host_paths = {volume["hostPath"]["path"] for volume in pod["volumes"] if "hostPath" in volume}
    kubelet_paths = {path for path in host_paths if path.startswith("/k/")}
    assert kubelet_paths == {"/k/plugins_registry", f"/k/plugins/{driver}", "/k/pod-resources"}
    (container,) = pod["containers"]
    assert {m["mountPath"] for m in container["volumeMounts"] if m["mountPath"].startswith("/k/")} == kubelet_paths
    policy = kinds["ValidatingAdmissionPolicy"]["spec"]
    variables = {variable["name"]: variable["expression"] for variable in policy["variables"]}
    assert "oldObject.spec.?driver" in variables["sliceDrivers"] and "object.spec.?driver" in variables["sliceDrivers"]
    assert f'variables.sliceDrivers.all(driver, driver == "{driver}")' in [
        v["expression"] for v in policy["validations"]
    ]
    result = helm_template(helm, "chart/gopherplug/ci/network-policy-values.yaml")
    assert result.returncode == 0, result.stderr
    [policy] = [doc for doc in yaml.safe_load_all(result.stdout) if doc and doc["kind"] == "NetworkPolicy"]
    ports = [(rule["ports"][0]["port"], rule["from"]) for rule in policy["spec"]["ingress"]]
    assert ports == [
        ("health", [{"ipBlock": {"cidr": "10.0.0.0/16"}}]),
        ("metrics", [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]),
    ]
    assert policy["spec"]["policyTypes"] == ["Ingress"]


@pytest.mark.parametrize("values", CHART_CI_VALUES)
def test_the_chart_lints_strict(helm, values):
    result = subprocess.run(
        [helm, "lint", "--strict", "chart/gopherplug", "-f", f"chart/gopherplug/ci/{values}"],
        cwd=HERE,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in result.stdout
    assert "[WARNING]" not in result.stdout and "[ERROR]" not in result.stdout, result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("values", CHART_CI_VALUES)
def test_the_charts_renders_are_valid_and_agree_with_their_configuration(helm, values, tmp_path):
    """Each ci/ values file's render: valid against the schemas of Kubernetes 1.34 to 1.37 (all but
    the PodMonitor, a CRD's kind kubernetes-validate has no schema for); its ConfigMap a
    configuration gopherplug accepts; and the rule of the Deployment section kept whatever the
    values: every directory of the configuration outside /dev and /sys a host directory mounted at
    the same path (type Directory: nothing created), every CDI spec directory mounted read-write,
    the kubelet's directories all under kubeletDir, the ports the configuration serves the
    container's named ones, and a PodMonitor that selects the DaemonSet's pods by the port's name."""
    given = yaml.safe_load((CHART / "ci" / values).read_text())
    result = helm_template(helm, f"chart/gopherplug/ci/{values}")
    assert result.returncode == 0, result.stderr
    render = tmp_path / values
    render.write_text(result.stdout)
    docs = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    checked = [doc for doc in docs if doc["kind"] != "PodMonitor"]
    for version in CHART_KUBERNETES_VERSIONS:
        validated = check("kubernetes-validate", "--strict", "-k", version, str(render))
        assert validated.returncode == 0, validated.stdout + validated.stderr
        assert validated.stdout.count(" passed ") == len(checked), validated.stdout
        assert validated.stdout.count("WARN") == len(docs) - len(checked), validated.stdout
    kinds = {doc["kind"]: doc for doc in docs}
    config = gp.parse_config(kinds["ConfigMap"]["data"]["config.yaml"], f"{values} ConfigMap")
    pod = kinds["DaemonSet"]["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    host_paths = {volume["name"]: volume["hostPath"] for volume in pod["spec"]["volumes"] if "hostPath" in volume}
    mounts = {mount["mountPath"]: mount for mount in container["volumeMounts"]}
    for path, mount in mounts.items():  # every hostPath at its own path
        assert mount["name"] not in host_paths or host_paths[mount["name"]]["path"] == path, mount
    for source in (source for resource in config.resources for source in resource.sources):
        if gp._is_under(source.directory, ["/dev", "/sys"]):
            continue
        assert mounts[source.directory].get("readOnly") is True, source.directory
        assert host_paths[mounts[source.directory]["name"]]["type"] == "Directory", source.directory
    for path in given.get("extraHostPaths", []):
        assert (mounts[path].get("readOnly"), host_paths[mounts[path]["name"]]["type"]) == (True, "Directory")
    spec_dirs = {resource.cdi.spec_dir for resource in config.resources if resource.cdi is not None}
    # Node Feature Discovery's directory, where the feature file is written (nfd.enabled).
    features = {os.path.dirname(config.nfd_features_file)} if config.nfd_features_file is not None else set()
    assert (config.nfd_features_file is not None) == bool(given.get("nfd", {}).get("enabled"))
    assert {path for path, mount in mounts.items() if not mount.get("readOnly")} - spec_dirs - features <= {
        mount for mount in mounts if mount.startswith(given.get("kubeletDir", "/var/lib/kubelet") + "/")
    }
    for path in spec_dirs | features:
        assert not mounts[path].get("readOnly") and host_paths[mounts[path]["name"]]["type"] == "DirectoryOrCreate"
    kubelet_dir = given.get("kubeletDir", "/var/lib/kubelet")
    kubelet_mounts = {path for path in mounts if "kubelet" in path}
    assert kubelet_mounts and all(path.startswith(kubelet_dir + "/") for path in kubelet_mounts), kubelet_mounts
    if config.dra is not None:
        assert config.dra.kubelet_dir == kubelet_dir
    if any(resource.api == "device-plugin" for resource in config.resources):
        assert config.device_plugin_dir == f"{kubelet_dir}/device-plugins" and config.device_plugin_dir in mounts
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports["health"] == int(config.health_address.rpartition(":")[2])
    assert ("metrics" in ports) == (config.metrics_address is not None)
    if config.metrics_address is not None:
        assert ports["metrics"] == int(config.metrics_address.rpartition(":")[2])
    if "PodMonitor" in kinds:
        monitor = kinds["PodMonitor"]["spec"]
        assert monitor["namespaceSelector"]["matchNames"] == [kinds["DaemonSet"]["metadata"]["namespace"]]
        assert monitor["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        assert [endpoint["port"] for endpoint in monitor["podMetricsEndpoints"]] == ["metrics"]
    classes = sorted(doc["metadata"]["name"] for doc in docs if doc["kind"] == "DeviceClass")
    assert len(classes) == 2 * sum(resource.api == "dra" for resource in config.resources)


def _config_error_sites():
    """Every ``raise ConfigError(...)`` that parse_config can reach (it and the module's functions it
    calls, transitively), read from gopherplug.py's source: {line: "function: key path: problem"},
    the key path and problem as their literal text with each computed part as {} (a problem built
    in a variable first is that variable's text as assigned before the raise)."""
    import ast

    tree = ast.parse((HERE / "gopherplug.py").read_text())
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}

    def text(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.JoinedStr):
            return "".join(part.value if isinstance(part, ast.Constant) else "{}" for part in node.values)
        if isinstance(node, ast.BinOp):
            return text(node.left) + text(node.right)
        return "{}"

    reached, todo = set(), ["parse_config"]
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            called = (node.func for node in ast.walk(functions[name]) if isinstance(node, ast.Call))
            todo += [f.id for f in called if isinstance(f, ast.Name) and f.id in functions]
    sites = {}
    for name in sorted(reached):
        assigned = sorted(
            (
                node
                for node in ast.walk(functions[name])
                if isinstance(node, ast.Assign | ast.AugAssign | ast.NamedExpr)
            ),
            key=lambda node: node.lineno,
        )
        for node in ast.walk(functions[name]):
            if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)):
                continue
            if getattr(node.exc.func, "id", "") != "ConfigError":
                continue
            _, where, problem = node.exc.args
            said = text(problem)
            if isinstance(problem, ast.Name):
                said = ""
                for assignment in (a for a in assigned if a.lineno < node.lineno):
                    target = assignment.targets[0] if isinstance(assignment, ast.Assign) else assignment.target
                    if isinstance(target, ast.Name) and target.id == problem.id:
                        value = text(assignment.value)
                        said = said + value if isinstance(assignment, ast.AugAssign) else value
            sites[node.lineno] = f"{name}: {text(where)}: {said}"
    return sites


def _resources(*resources, **values):
    """Chart values with these resources in config."""
    return {**values, "config": {"resources": list(resources)}}


def _dra(*resources, **values):
    return _resources(*resources, mode="dra", **values)


#: Every refusal of parse_config (a _config_error_sites() entry) and its counterpart at render:
#: ("template", values, what both say): the chart's templates/_validate.tpl fails with check-config's
#: sentence; ("template", values, what check-config says, what the chart says): the same refusal
#: in the chart's words, where the fix is in the values rather than in the file; ("schema", values,
#: what helm says): values.schema.json refuses it in a line that names the key and says what is
#: wanted; or the reason no values file can bring it to a node.
RENDER_REFUSALS = {
    "_absolute_path: {}: {} must be an absolute path": (
        "template",
        _resources({"name": "example.com/gopher", "directory": "gophers"}),
        "config.resources[0].directory: 'gophers' must be an absolute path",
    ),
    "_allowed_root: {}: '/' would allow every host path: list the directories you need": (
        "template",
        _resources(_gopher(allowed_host_paths=["/"])),
        "config.resources[0].allowed_host_paths[0]: '/' would allow every host path",
    ),
    "_flag: {}.{}: {}: must be true or false": (
        "schema",
        _resources(_gopher(allow_mounted="yes")),
        "at '/config/resources/0/allow_mounted': got string, want boolean",
    ),
    "_host_path_template: {}: {}: a host path can use {id}, {path}, {name} and {target}, not {index}": (
        "template",
        _resources(_gopher(mounts=[{"host_path": "/dev/g{index}", "container_path": "/g"}])),
        "config.resources[0].mounts[0].host_path: '/dev/g{index}': a host path can use",
    ),
    "_host_path_template: {}: {} is outside {}: add its directory to allowed_host_paths": (
        "template",
        _resources(_gopher(mounts=[{"host_path": "/usr/lib/x86_64-linux-gnu/libcuda.so.1", "container_path": "/l"}])),
        "config.resources[0].mounts[0].host_path: '/usr/lib/x86_64-linux-gnu/libcuda.so.1' is outside /dev: "
        "add its directory to allowed_host_paths",
    ),
    "_list: {}: must be a list": (
        "schema",
        _resources(_gopher(mounts="/g")),
        "at '/config/resources/0/mounts': got string, want array",
    ),
    "_mapping: {}: must be a mapping of keys to values: write {}: {}, with a space after the colon ({} is one "
    "word to YAML), not a list: a key of a mapping takes no '- '": (
        "schema",
        _resources("name:example.com/gopher"),
        "at '/config/resources/0': got string, want object",
    ),
    "_mapping: {}: is required": (
        "schema",
        _resources({"directory": "/dev"}),
        "at '/config/resources/0': missing property 'name'",
    ),
    "_mapping: {}: unknown key; {}expected one of {}": (
        "schema",
        _resources({"name": "example.com/gopher", "directroy": "/etc/gophers"}),
        "at '/config/resources/0': additional properties 'directroy' not allowed",
    ),
    "_parse_annotations: {}: must be a mapping of annotation keys to values": (
        "schema",
        _resources(_gopher(annotations="a=b")),
        "at '/config/resources/0/annotations': got string, want object",
    ),
    "_parse_annotations: {}.{}: a key can use {id} and {index}, not a path or name": (
        "template",
        _resources(_gopher(annotations={"example.com/{path}": "x"})),
        "config.resources[0].annotations.example.com/{path}: a key can use {id} and {index}",
    ),
    "_parse_annotations: {}.{}: not a valid annotation key: [prefix/]name, a name of at most 63 letters, "
    "digits, '-', '_', '.'": (
        "template",
        _resources(_gopher(annotations={"example.com/a b": "x"})),
        "config.resources[0].annotations.example.com/a b: not a valid annotation key",
    ),
    "_parse_annotations: {}.{}: {}: must be a string (quote it)": (
        "schema",
        _resources(_gopher(annotations={"example.com/a": 1})),
        "at '/config/resources/0/annotations/example.com~1a': got number, want string",
    ),
    "_parse_annotations: {}.{}: {}: an annotation is per device, not per entry: use {id}, {path} or {index}": (
        "template",
        _resources(_gopher(annotations={"example.com/a": "{name}"})),
        "config.resources[0].annotations.example.com/a: '{name}': an annotation is per device",
    ),
    "_parse_api: {}.api: both is no longer accepted: {}": (
        "schema",
        _resources(_gopher(api="both")),
        "at '/config/resources/0/api': value must be one of 'device-plugin', 'dra'",
    ),
    "_parse_api: {}.api: {}: must be one of {}": (
        "schema",
        _resources(_gopher(api="cdi")),
        "at '/config/resources/0/api': value must be one of 'device-plugin', 'dra'",
    ),
    "_parse_api: {}.api: {} needs the DRA driver: add dra: {driver: <name>} at the top of the file": (
        "template",
        _resources(_gopher(api="dra")),
        "dra needs the DRA driver",
        "config.resources[0].api: dra needs the DRA driver: set mode: dra",
    ),
    "_parse_api: {}.name: with api: {}, the name is a device attribute: at most {} characters": (
        "template",
        _dra(_gopher(api="dra", name="example.com/" + "g" * 60)),
        "the name is a device attribute: at most 64 characters",
    ),
    "_parse_cdi: {}.kind: {}: must be vendor/class, e.g. example.com/gopher (a DNS name, then 2 to 63 of A-Z "
    "a-z 0-9 _ . -; each beginning with a letter)": (
        "template",
        _resources(_gopher(cdi={"kind": "example.com"})),
        "config.resources[0].cdi.kind: 'example.com': must be vendor/class, e.g. example.com/gopher",
    ),
    "_parse_cdi: {}.kind: {}: a one-character vendor or class crashes containerd 2.x at every start (its CDI "
    "library v1.1.0 panics on such a spec file): use 2 characters or more": (
        "template",
        _resources(_gopher(cdi={"kind": "example.com/g"})),
        "config.resources[0].cdi.kind: 'example.com/g': a one-character vendor or class crashes containerd 2.x",
    ),
    "_parse_cdi: {}.kind: {} is too long to name a file after: at most 244 characters": (
        "template",
        _resources(_gopher(cdi={"kind": ".".join(["a" * 60] * 4) + "/gopher"})),
        "is too long to name a file after: at most 244 characters",
    ),
    "_parse_command: {}: must be a non-empty list: the program, then its arguments (no shell)": (
        "schema",
        _resources(_gopher(pre_start=[])),
        "at '/config/resources/0/pre_start': minItems: got 0, want 1",
    ),
    "_parse_command: {}[0]: {} is relative, and this configuration has no file here to resolve it against: make it "
    "absolute": (
        "template",
        _resources(_gopher(describe=["./describe-accel"])),
        "config.resources[0].describe[0]: './describe-accel' is relative, and this configuration has no file here to "
        "resolve it against: make it absolute",
    ),
    "_parse_command: {}[0]: {} is not an executable file here or on PATH": (
        "the program is looked for on the node, on the image's PATH: not in the values"
    ),
    "_parse_declarations: {}: {} attributes and {} capacities, with the {} gopherplug gives each device, are {}: "
    "the API server takes at most {} a device": (
        "template",
        _dra(_gopher(api="dra", attributes={f"a{n}": n for n in range(30)})),
        "config.resources[0].attributes: 30 attributes and 0 capacities, with the 3 gopherplug gives each device, "
        "are 33: the API server takes at most 32 a device",
    ),
    "_parse_declared: {}: is an attribute gopherplug gives every device itself ({}): choose another name, or one "
    "in a domain of your own (example.com/{})": (
        "template",
        _dra(_gopher(api="dra", attributes={"id": "x"})),
        "config.resources[0].attributes.id: is an attribute gopherplug gives every device itself (healthy, id, "
        "numaNode, resource, usbBus, usbPort, usbProduct, usbSerial, usbVendor): choose another name",
    ),
    "_parse_declared: {}: is the capacity gopherplug gives a shared device (replicas): choose another name": (
        "template",
        _dra(_gopher(api="dra", capacity={"shares": 1})),
        "config.resources[0].capacity.shares: is the capacity gopherplug gives a shared device (replicas)",
    ),
    "_parse_declared: {}: must be a mapping of {}": (
        "schema",
        _dra(_gopher(api="dra", attributes="model=x")),
        "at '/config/resources/0/attributes': got string, want object",
    ),
    "_parse_declared: {}: not a valid name for the API server: {}": (
        "template",
        _dra(_gopher(api="dra", attributes={"bad-name": "x"})),
        "config.resources[0].attributes.bad-name: not a valid name for the API server",
    ),
    "_parse_declared_value: {}.file: {} must be an absolute path": (
        "template",
        _dra(_gopher(api="dra", attributes={"model": {"file": "x/model"}})),
        "config.resources[0].attributes.model.file: 'x/model' must be an absolute path",
    ),
    "_parse_declared_value: {}.file: {}: bad placeholder ({}); use {{}}": (
        "template",
        _dra(_gopher(api="dra", attributes={"model": {"file": "{path}/{serial}"}})),
        "config.resources[0].attributes.model.file: '{path}/{serial}': bad placeholder",
    ),
    "_parse_declared_value: {}.type: {}: must be one of {}": (
        "template",
        _dra(_gopher(api="dra", attributes={"model": {"file": "{path}/model", "type": "float"}})),
        "config.resources[0].attributes.model.type: 'float': must be one of string, int, bool, version",
    ),
    "_parse_declared_value: {}: not a valid {} attribute for the API server: {}": (
        "template",
        _dra(_gopher(api="dra", attributes={"model": "x" * 70})),
        "config.resources[0].attributes.model: not a valid string attribute for the API server",
    ),
    "_parse_declared_value: {}: {} is not a quantity: a number with an optional suffix (4, 80Gi, 1500m, 2k), or "
    "{file: <path>} to read one": (
        "template",
        _dra(_gopher(api="dra", capacity={"memory": "80 GB"})),
        "config.resources[0].capacity.memory: '80 GB' is not a quantity: a number with an optional suffix",
    ),
    '_parse_declared_value: {}: {}: must be a string, a whole number, true or false, {version: "1.2.3"}, or '
    "{file: <path>, type: string|int|bool|version}": (
        "template",
        _dra(_gopher(api="dra", attributes={"model": [1, 2]})),
        'must be a string, a whole number, true or false, {version: "1.2.3"}, or {file: <path>, type: '
        "string|int|bool|version}",
    ),
    "_parse_device_spec: {}.permissions: {}: use letters from r, w and m, each once": (
        "template",
        _resources(_gopher(device_specs=[{"host_path": "{path}", "container_path": "{path}", "permissions": "rr"}])),
        "config.resources[0].device_specs[0].permissions: 'rr': use letters from r, w and m, each once",
    ),
    "_parse_dra: {}.driver: {}: must be a lower-case DNS subdomain of at most {} characters, e.g. "
    "gopherplug.example.com": (
        "template",
        _dra(_gopher(api="dra"), dra={"driver": "Gopherplug.example.com"}),
        "dra.driver: 'Gopherplug.example.com': must be a lower-case DNS subdomain of at most 63 characters",
    ),
    "_parse_dra: {}.unhealthy_taint: {}: must be NoSchedule (keep new claims off an unhealthy device) or "
    "NoExecute (also evict)": (
        "schema",
        _dra(_gopher(api="dra"), dra={"unhealthyTaint": "Evict"}),
        "at '/dra/unhealthyTaint': value must be one of 'NoSchedule', 'NoExecute'",
    ),
    "_parse_dra: {}.device_metadata: {}: must be true (the default: each claim's containers get a file "
    "describing their devices) or false": (
        "schema",
        _dra(_gopher(api="dra"), dra={"deviceMetadata": "yes"}),
        "at '/dra/deviceMetadata': got string, want boolean",
    ),
    "_parse_dra: {}: {}": (
        "template",
        _dra(_gopher(api="dra"), kubeletDir="/var/lib/" + "k" * 60),
        "would pass the 107 bytes unix sockets allow: choose a shorter driver name",
    ),
    "_parse_id_pattern: {}: {} has no group named id: mark the part of the name that is the ID with (?P<id>...)": (
        "template",
        _resources(_gopher(id_pattern="gopher[0-9]+")),
        "config.resources[0].id_pattern: 'gopher[0-9]+' has no group named id",
    ),
    "_parse_id_pattern: {}: {} is not a regular expression: {}": (
        "Python's re is not Go's regexp (lookarounds, backreferences, possessive quantifiers): only the "
        "plugin's own re can say what it refuses; check-config does, on the ConfigMap"
    ),
    "_parse_mount: {}.read_only: {}: must be true or false": (
        "schema",
        _resources(_gopher(mounts=[{"host_path": "{path}", "container_path": "/g", "read_only": "no"}])),
        "at '/config/resources/0/mounts/0/read_only': got string, want boolean",
    ),
    "_parse_resource: {}.allow_double_booking: is no longer accepted: {}": (
        "schema",
        _resources(_gopher(allow_double_booking=True)),
        "at '/config/resources/0': additional properties 'allow_double_booking' not allowed",
    ),
    "_parse_resource: {}.name: {}: {}": (
        "template",
        _resources({"name": "kubernetes.io/gopher", "directory": "/etc/gophers"}),
        "config.resources[0].name: 'kubernetes.io/gopher': the kubernetes.io domain is reserved",
    ),
    "_parse_resource: {}.directory: is required, unless match or usb says where the devices are": (
        "template",
        _resources({"name": "example.com/gopher"}),
        "config.resources[0].directory: is required, unless match or usb says where the devices are",
    ),
    "_parse_resource: {}.usb: and {} in one resource would offer both kinds of device as one list: give the "
    "USB devices a resource of their own": (
        "template",
        _resources(_gopher(usb=[{"vendor": "1050", "product": "0407"}])),
        "config.resources[0].usb: and directory in one resource would offer both kinds of device as one list",
    ),
    "_parse_resource: {}.id_pattern: names directory entries, and this resource has none: a USB device's ID is "
    "its serial or port": (
        "template",
        _resources({"name": "example.com/key", "usb": [{"vendor": "1050", "product": "0407"}], "id_pattern": "x"}),
        "config.resources[0].id_pattern: names directory entries, and this resource has none",
    ),
    "_parse_resource: {}.env: {} is not a valid environment variable name": (
        "template",
        _resources(_gopher(env="GOPHER-DEVICES")),
        "config.resources[0].env: 'GOPHER-DEVICES' is not a valid environment variable name",
    ),
    "_parse_resource: {}.env: {}, the default for {}, is given meaning by the shell or the dynamic loader: set env": (
        "template",
        _resources(_gopher(env="LD_PRELOAD")),
        "config.resources[0].env: 'LD_PRELOAD' is given meaning by the shell or the dynamic loader: "
        "choose another name",
    ),
    "_parse_resource: {}.env: {} is set by gopherplug for pre_start: choose another name": (
        "template",
        _resources(_gopher(env="GOPHERPLUG_RESOURCE")),
        "config.resources[0].env: 'GOPHERPLUG_RESOURCE' is set by gopherplug for pre_start",
    ),
    "_parse_resource: {}: {}{} in {} offers every entry there read-write, disks, kmsg and mem among them: "
    "name the devices (e.g. 'ttyUSB*'), or set whole_dev: true": (
        "template",
        _resources({"name": "example.com/gpu", "directory": "/dev"}),
        "config.resources[0].pattern: '*' (the default) in /dev offers every entry there read-write",
    ),
    "_parse_resource: {}.whole_dev: is for a pattern that matches every entry of {}, and this resource has "
    "none: remove it": (
        "template",
        _resources(_gopher(whole_dev=True)),
        "config.resources[0].whole_dev: is for a pattern that matches every entry of /dev",
    ),
    "_parse_resource: {}.replicas: {}: must be a whole number from 1 to {}": (
        "schema",
        _resources(_gopher(replicas=0)),
        "at '/config/resources/0/replicas': minimum: got 0, want 1",
    ),
    "_parse_resource: {}.preferred: {}: must be packed or spread": (
        "schema",
        _resources(_gopher(preferred="first")),
        "at '/config/resources/0/preferred': value must be one of 'packed', 'spread'",
    ),
    "_parse_resource: {}.pre_start_timeout: {}: must be a number of seconds, more than 0 and less than the "
    "kubelet's 30": (
        "schema",
        _resources(_gopher(pre_start_timeout=30)),
        "at '/config/resources/0/pre_start_timeout'",
    ),
    "_parse_resource: {}.env: {}: with cdi, each device sets {}_<ID>, which could name a variable the shell or "
    "the dynamic loader give meaning to: choose another name": (
        "template",
        _resources(_gopher(env="BASH", cdi={"kind": "example.com/gopher"})),
        "config.resources[0].env: 'BASH': with cdi, each device sets BASH_<ID>",
    ),
    "_parse_resource: {}.{}: is for the device-plugin API, and this resource has api: dra ({})": (
        "template",
        _dra(_gopher(api="dra", preferred="spread")),
        "config.resources[0].preferred: is for the device-plugin API, and this resource has api: dra",
    ),
    "_parse_resource: {}.{}.container_path: {}: with cdi, a device is described once, not per allocation: use "
    "{id} instead of {index}": (
        "template",
        _resources(
            _gopher(cdi={"kind": "example.com/gopher"}, mounts=[{"host_path": "{path}", "container_path": "/g{index}"}])
        ),
        "config.resources[0].mounts[0].container_path: '/g{index}': with cdi, a device is described once",
    ),
    "_parse_sources: {}.match: must list at least one {directory, pattern}": (
        "schema",
        _resources({"name": "example.com/gopher", "match": []}),
        "at '/config/resources/0/match': minItems: got 0, want 1",
    ),
    "_parse_sources: {}.pattern: names entries of a directory: give directory too": (
        "template",
        _resources({"name": "example.com/key", "usb": [{"vendor": "1050", "product": "0407"}], "pattern": "g*"}),
        "config.resources[0].pattern: names entries of a directory: give directory too",
    ),
    "_parse_sources: {}.{}: goes in a match entry when match is given (directory and pattern are a match of one)": (
        "template",
        _resources({"name": "example.com/gopher", "directory": "/dev", "match": [{"directory": "/dev/g"}]}),
        "config.resources[0].directory: goes in a match entry when match is given",
    ),
    "_parse_sources: {}: repeats match[{}]": (
        "template",
        _resources({"name": "example.com/gopher", "match": [{"directory": "/dev/g"}, {"directory": "/dev/g/"}]}),
        "config.resources[0].match[1]: repeats match[0]",
    ),
    '_parse_usb: {}.{}: {}: must be 4 hex digits in quotes, as lsusb prints them (e.g. "0407")': (
        "template",
        _resources({"name": "example.com/key", "usb": [{"vendor": 1050, "product": "0407"}]}),
        'config.resources[0].usb[0].vendor: 1050: must be 4 hex digits in quotes, as lsusb prints them (e.g. "0407")',
    ),
    "_placeholders: {}: {}: bad placeholder ({}); use {id}, {path}, {name}, {target} or {index}": (
        "template",
        _resources(_gopher(mounts=[{"host_path": "{path}", "container_path": "/g/{serial}"}])),
        "config.resources[0].mounts[0].container_path: '/g/{serial}': bad placeholder",
    ),
    "_refuse_generic_device_plugin_keys: {}.{}: is generic-device-plugin's, not gopherplug's: {} "
    "(docs/generic-device-plugin.md translates each of its keys)": (
        "schema",
        _resources(_gopher(groups=[{"paths": [{"path": "/dev/gopher"}]}])),
        "at '/config/resources/0': additional properties 'groups' not allowed",
    ),
    "_string: {}: must be a non-empty string, not {} (put it in quotes)": (
        "schema",
        _resources(_gopher(env=7)),
        "at '/config/resources/0/env': got number, want string",
    ),
    "_string: {}: must be a non-empty string": (
        "schema",
        _resources(_gopher(env="")),
        "at '/config/resources/0/env': minLength: got 0, want 1",
    ),
    "_template: {}: {} must be an absolute path": (
        "template",
        _resources(_gopher(mounts=[{"host_path": "{path}", "container_path": "{name}"}])),
        "config.resources[0].mounts[0].container_path: '{name}' must be an absolute path",
    ),
    "parse_config: {}: {}: write {} if you meant that, or {} without the leading zero": (
        "Helm reads the values file itself (YAML 1.1 too): a number written 010 reaches the chart as 8, "
        "and the ConfigMap says 8; the schema and the templates check what it became"
    ),
    "parse_config: : is empty: it needs resources, a list of the devices to offer (docs/configuration.md)": (
        "the chart always writes resources (values.yaml has them, the schema requires a non-empty list)"
    ),
    "parse_config: resources: must be a non-empty list of resources": (
        "schema",
        _resources(),
        "at '/config/resources': minItems: got 0, want 1",
    ),
    "parse_config: dra: no resource has api: dra, so the driver would offer nothing": (
        "template",
        _dra(_gopher()),
        "no resource has api: dra, so the driver would offer nothing",
        "mode: dra: no resource has api: dra, so the driver would offer nothing",
    ),
    "parse_config: : {}": "Helm parses the values file before the chart: a YAML mistake is its own error, "
    "with its line",
    'parse_config: {}: {}: write it in quotes, as lsusb prints it ("{}")': (
        "Helm reads the values file itself: an unquoted 0407 reaches the chart as the number 263, which the "
        "template refuses as not 4 hex digits in quotes (_parse_usb's sentence)"
    ),
    "parse_config: device_plugin_dir: {}": (
        "template",
        _resources(_gopher(), kubeletDir="/var/lib/" + "k" * 60),
        "characters long: a socket path in it would pass the 107 bytes unix sockets allow",
    ),
    "parse_config: nfd_features_file: {}": (
        "the chart writes nfd_features_file as nfd.featuresDir (checked absolute at render) and the release's "
        "fullname, a DNS label, which never begins with '.'"
    ),
    "parse_config: metrics_address: {}": (
        "schema",
        {"metrics": {"port": 70000}},
        "at '/metrics/port': maximum: got 70,000, want 65,535",
    ),
    "parse_config: health_address: {}": (
        "schema",
        {"health": {"port": 70000}},
        "at '/health/port': maximum: got 70,000, want 65,535",
    ),
    "parse_config: {}: {} is the CDI kind of the device metadata gopherplug mounts into claims' containers "
    "(dra.device_metadata): give the resource another cdi.kind": (
        "template",
        _dra(_gopher(api="dra", name="example.com/metadata")),
        "config.resources[0].name: 'gopherplug.example.com/metadata' is the CDI kind of the device metadata",
    ),
    "parse_config: resources[{}].name: {} is already used by resources[{}]": (
        "template",
        _resources(_gopher(name="example.com/gpu"), _gopher(name="example.com/gpu", pattern="nvidia*")),
        "config.resources[1].name: example.com/gpu is already used by resources[0]",
    ),
    "parse_config: resources[{}].cdi.kind: {} would share the CDI spec file {} with resources[{}]: give each "
    "resource its own kind": (
        "template",
        _resources(
            _gopher(cdi={"kind": "example.com/gopher"}),
            _gopher(name="example.com/other", pattern="o*", cdi={"kind": "example.com/gopher"}),
        ),
        "config.resources[1].cdi.kind: 'example.com/gopher' would share the CDI spec file "
        "/var/run/cdi/example.com-gopher.json with resources[0]",
    ),
    "parse_config: resources[{}].name: {} would share a DRA pool name with {} of resources[{}]": (
        "template",
        _dra(_gopher(api="dra", name="example.com/my_dev"), _gopher(api="dra", name="example.com/my-dev", env="MY")),
        "config.resources[1].name: example.com/my-dev would share a DRA pool name with example.com/my_dev",
    ),
    "parse_config: resources[{}].env: {} is also the env of {} (resources[{}]): a container given devices of "
    "both would see one list; set another env on {}, or shared_with if both offer the same devices": (
        "template",
        _resources(_gopher(name="example.com/gpu"), _gopher(name="acme.com/gpu", pattern="nvidia*")),
        "config.resources[1].env: GPU_DEVICES is also the env of example.com/gpu (resources[0]): a container given "
        "devices of both would see one list; set another env on acme.com/gpu, or shared_with if both offer the same "
        "devices",
    ),
    "parse_config: resources[{}].shared_with[{}]: {} {}: list the resources that may offer the same device "
    "nodes as this one": (
        "template",
        _resources(_gopher(shared_with=["example.com/nothing"])),
        "config.resources[0].shared_with[0]: 'example.com/nothing' names no resource of this file",
    ),
}


def _chart_configuration(values):
    """The configuration file the chart writes from ``values`` (templates/configmap.yaml), as data."""
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    mode = values.get("mode", defaults["mode"])
    kubelet_dir = values.get("kubeletDir", defaults["kubeletDir"])
    dra = {**defaults["dra"], **values.get("dra", {})}
    resources = values.get("config", defaults["config"])["resources"]
    config = {}
    if mode != "dra" or any(not isinstance(r, dict) or r.get("api", "device-plugin") != "dra" for r in resources):
        config["device_plugin_dir"] = f"{kubelet_dir}/device-plugins"
    ports = {"metrics": 9401 if mode == "dra" else 9400, "health": 9403 if mode == "dra" else 9402}
    for key in ("metrics", "health"):
        port = {**defaults[key], **values.get(key, {})}["port"]
        config[f"{key}_address"] = f"0.0.0.0:{ports[key] if port is None else port}"
    if mode == "dra":
        config["dra"] = {
            "driver": dra["driver"],
            "kubelet_dir": kubelet_dir,
            "unhealthy_taint": dra["unhealthyTaint"],
            "device_metadata": dra["deviceMetadata"],
        }
    return {**config, "resources": resources}


@pytest.mark.slow
def test_every_refusal_of_parse_config_is_refused_at_render():
    """One source of truth: each refusal parse_config can raise (read from its source) has a values
    file in RENDER_REFUSALS that the chart refuses at render, or the reason none can: a refusal added
    to gopherplug.py without one fails here, and so does an entry left after its refusal is gone.
    The values files themselves are rendered by the test below."""
    sites = set(_config_error_sites().values())
    assert sorted(sites - RENDER_REFUSALS.keys()) == [], "refusals with no render-time counterpart"
    assert sorted(RENDER_REFUSALS.keys() - sites) == [], "counterparts of refusals parse_config no longer has"


@pytest.mark.slow
@pytest.mark.parametrize("site", sorted(key for key, case in RENDER_REFUSALS.items() if not isinstance(case, str)))
def test_the_chart_refuses_at_render_what_check_config_refuses(helm, site, tmp_path):
    """The case's values, as the ConfigMap the chart would write, are refused by parse_config at that
    very raise (the traceback's line); and `helm template` refuses them: a template with the same
    sentence, or the schema in a line that names the key. No line of the chart's own says 'not'
    failed or prints a regex."""
    how, values, says, *chart_says = RENDER_REFUSALS[site]
    text = yaml.safe_dump(_chart_configuration(values))
    with pytest.raises(gp.ConfigError) as caught:
        gp.parse_config(text, "config.yaml")
    raised = [frame for frame in traceback.extract_tb(caught.tb) if frame.filename == gp.__file__][-1]
    assert _config_error_sites().get(raised.lineno) == site, (str(caught.value), raised.lineno)
    if how == "template":
        assert says in caught.value.problem or says.partition(": ")[2] in str(caught.value), str(caught.value)
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    result = helm_template(helm, str(path))
    assert result.returncode == 1 and result.stdout == "", result.stdout
    said = chart_says[0] if chart_says else says
    if how == "template":
        assert f"execution error at (gopherplug/templates/configmap.yaml:1:4): {said}" in result.stderr or (
            said in result.stderr and "execution error" in result.stderr
        ), result.stderr
    else:
        assert "values don't meet the specifications of the schema(s)" in result.stderr, result.stderr
        assert said in result.stderr, result.stderr
    assert "'not' failed" not in result.stderr and "does not match pattern" not in result.stderr, result.stderr


# The differential test of the chart's attribute and capacity checks against parse_config: values
# generated from each rule's conditions, every boundary among them, judged by both. Each rule's edge
# from both sides: lengths in bytes (ASCII, 2-, 3- and 4-byte UTF-8), ASCII and other digits, int64's
# ends (and Helm's float64 on the way: every number of the values is one), semantic versions, the
# quantity's every form, a value of every type, names with and without a domain, the reserved ones.
_INT64 = 2**63


_LONG = {"ascii": "a", "2-byte": "é", "3-byte": "€", "4-byte": "\U0001f600"}


def _by_bytes(unit, size):
    """A string of ``size`` bytes or the fewest more, made of ``unit`` (padded with ASCII)."""
    count = size // len(unit.encode())
    return unit * count + "a" * (size - count * len(unit.encode()))


_NAMES = [
    *("a" * n for n in (1, 32, 33)),
    *("_a", "a1", "1a", "a-b", "a.b", "", "é", "a\u0663", "\uff41", "A_Z_9", "a\n"),
    *(f"{'a' * n}/x" for n in (1, 63, 64)),
    *(f"{'a.' * 31}a/x", f"{'a.' * 32}a/x"),  # 63 and 65 bytes of labels
    *("\u212a" * n + "/x" for n in (1, 21, 22)),  # KELVIN SIGN: lower-cases to "k", 3 bytes each
    *("\u0130.com/x", "EXAMPLE.com/x", "-a.com/x", "a..b/x", "a.com-/x", "/x", "a.com/", "a/b/c", "\u0663.com/x"),
    *("a.com/" + "a" * n for n in (32, 33)),
    *("id", "healthy", "resource", "numaNode", "usbPort", "shares", "x.com/shares"),
    *("gopherplug.example.com/id", "gopherplug.example.com/healthy", "example.com/id", "Gopherplug.example.com/id"),
]


_NUMBERS = [
    *(0, 1, -1, 1.0, 1.5, -0.0, 0.1, 1e-7, 1.5e-7, 2e-7, 123456789.5, 1e20, 1e21, 1.5e21, 1e308, -1e20),
    *(2**53, 2**53 + 1, _INT64 - 1, _INT64, _INT64 - 512, _INT64 - 1024, _INT64 - 2048, 2**64, 2**64 + 1),
    *(-_INT64, -_INT64 + 1, -_INT64 + 1024, -_INT64 - 1, -(2**64), 9.2e18, 9.3e18, 10**19, 15 * 10**18, 10**26),
    2**64 - 2**11,  # the largest float64 below 2^64: toYaml writes its 20 digits (Go's YAML takes it as a uint64)
]


_STRINGS = [
    *(_by_bytes(unit, size) for unit in _LONG.values() for size in (63, 64, 65)),
    *("", "x", "true", "True", "yes", "n", "null", "~", "1", "1.5", "1e3", "1e+20", "0x10", "010", "1_000", "1:20"),
    *("2001-12-14", ".inf", ".nan", " x", "x ", "x\n", "\t", "\x7f", "\u0085", "\u2028", "\ufeff", "a: b", "- x"),
    *("#x", "'", '"', "{x}", "[1]", "*a", "&a", "!x", "%x", "@x", "`x", "|", ">", "?", "=", "<<", "\u0663"),
    *("1.5e+999", "-1.5e+999", "1_0.5e+999", "1_0.5e+5", "1.5e-999", "._5e+999", ".5_5e+999", "1.5e999", "0.0e+999"),
]


_VERSIONS = [
    *("1.2.3", "0.0.0", "01.2.3", "1.02.3", "1.2", "1.2.3.4", "v1.2.3", " 1.2.3", "1.2.3\n", "1.2.3 "),
    *("1.2.3-alpha", "1.2.3-alpha.1", "1.2.3-0", "1.2.3-01", "1.2.3-0a", "1.2.3--", "1.2.3-", "1.2.3-a..b"),
    *("1.2.3+build", "1.2.3+build.01", "1.2.3+", "1.2.3+b.", "1.2.3-a+b", "1.2.3-alpha_1", "1.2.3-\u00e9"),
    *("\u0661.2.3", "1.2.\u0663", "1.2.3-\u0663", "\uff11.2.3", "99999999999999999999.0.0"),
    *("1.2.3-" + "a" * (size - 6) for size in (64, 65)),
]


_QUANTITIES = [
    *("1", "0", "-0", "+1", "-1", "1.", ".5", ".", "+", "-", "+.", "", "00001", "1.5Gi", "1000", "1e3"),
    *("Ki", "k", "E", "e5", "-e5", "2E", "1Ei", "8Ei", "16Ei", "9Ei", "1n", "1u", "1m", "1k", "1M", "1G", "1T", "1P"),
    *("1e9999999", "1e-9999999", "1e+5", "1E5", "1E+5", "1e", "1e+", "1E-", "1ee5", "1.5.5", "1 ", " 1", "1k5"),
    *("1Kix", "1ki", "1KI", "1K", "0x10", "1_000", "\u0661", "1e\u0663", "1\u00b5", "1i", "1Ki5", "1e0000000000005"),
    *(f"1e{sign}{e}" for sign in ("", "+", "-") for e in (_INT64 - 1, _INT64, _INT64 + 1, 2**31, 2**32)),
    *(f"1e{sign}{e}" for sign in ("", "+", "-") for e in (2**31 - 1, "02147483647", "0" * 12 + "5")),
    *("10e2147483646", "1000e2147483647", "0e2147483647", "0.000e99", "1.5e-2147483647"),
    *(f"{'1234567890' * 2}"[:n] + suffix for n in (18, 19, 20) for suffix in ("e21", "E", "000E", "e18", "e19")),
    *("-1234567890123456789e21", "1234567890123456789.5e21", "123456789012345678.9e22", "1" * 40, "1" * 40 + "k"),
    *(1.2345678901234567e300, 1e300, 1.7976931348623157e308, -1.2345678901234567e300, 1.2345678901234567e21),
]


_TYPED_KEYS = ("string", "int", "bool", "version", "float", "quantity")


SECTIONS = ("attributes", "capacity")


_FILES = [
    *({"file": f} for f in ("/x", "{path}/x", "{sysfs}/numa_node", "{target}", "{id}/x", "x", "", "{serial}/x")),
    *({"file": f} for f in ("/{{x}}", "{{path}}/x", "/x{", "/x}", "/{}", "{}/x", "{0}/x", "/x{id}{name}")),
    *({"file": f} for f in (5, None, True, ["/x"])),
    *({"file": "/x", "type": t} for t in (*_TYPED_KEYS, None, 1, "String")),
    {"file": "/x", "typo": 1},
    {"file": "/x", "type": "int", "more": 1},
]


_OTHERS = [True, False, None, [], ["x"], {}, {"a": 1}, {"string": "x", "int": 1}, {"version": "1.2.3", "x": 1}]


def _boundary_cases():
    """Every boundary, in both sections: (section, key, value, mode)."""
    cases = [(section, name, "x" if section == "attributes" else "1") for name in _NAMES for section in SECTIONS]
    for section in SECTIONS:
        for value in (*_NUMBERS, *_STRINGS, *_QUANTITIES, *_FILES, *_OTHERS):
            cases.append((section, "model", value))
    others = ("x", "1", "true", "1.2.3", 1, True, None, [], {"a": 1})
    typed = {
        "string": (*_STRINGS, *_NUMBERS, *others),
        "version": (*_VERSIONS, *_STRINGS[:9], 1, 1e20, *others),
        "int": (*_NUMBERS, *others),
        "bool": (False, *others),
    }
    cases += [("attributes", "model", {kind: value}) for kind in _TYPED_KEYS for value in typed.get(kind, others)]
    cases += [("attributes", "model", version) for version in _VERSIONS]
    return [(*case, "dra") for case in cases] + [
        (section, name, "x" if section == "attributes" else "1", "device-plugin")
        for name in _NAMES
        for section in SECTIONS
    ]


_TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=70)


_SOME_TEXT = st.one_of(
    _TEXT,
    st.text(st.sampled_from("aZ_9.-/é€\U0001f600\u0663\u212a\u0130 "), max_size=70),
    st.builds(_by_bytes, st.sampled_from(list(_LONG.values())), st.integers(60, 68)),
)


_NUMBER = st.one_of(
    st.integers(-(2**65), 2**65),
    st.sampled_from([_INT64 + d for d in range(-3000, 3001, 97)] + [-_INT64 + d for d in range(-3000, 3001, 97)]),
    st.floats(allow_nan=False, allow_infinity=False),
)


_QUANTITY = st.builds(
    "".join,
    st.tuples(
        st.sampled_from(["", "+", "-"]),
        st.text("0123456789", max_size=4),
        st.sampled_from(["", ".", ".5", ".05"]),
        st.one_of(
            st.sampled_from(
                ["", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei", "n", "u", "m", "k", "M", "G", "T", "P", "E", "e", "i"]
            ),
            st.builds(
                lambda e, sign: f"e{sign}{e}",
                st.one_of(st.integers(0, 2**70), st.sampled_from([_INT64 - 1, _INT64, 2**31 - 1, 2**31])),
                st.sampled_from(["", "+", "-"]),
            ),
        ),
    ),
)


_SEMVER_PART = st.one_of(
    st.sampled_from(["0", "1", "01", "10", "a", "-", "0a", "a-1", "\u0661", ""]), st.text("0a-", max_size=3)
)


_VERSION = st.builds(
    lambda parts, pre, build: (
        ".".join(parts) + (f"-{'.'.join(pre)}" if pre else "") + (f"+{'.'.join(build)}" if build else "")
    ),
    st.lists(_SEMVER_PART, min_size=2, max_size=4),
    st.lists(_SEMVER_PART, max_size=3),
    st.lists(_SEMVER_PART, max_size=2),
)


_SCALAR = st.one_of(_SOME_TEXT, _NUMBER, st.booleans(), st.none(), _QUANTITY, _VERSION)


_DECLARED_VALUE = st.one_of(
    _SCALAR,
    st.dictionaries(st.sampled_from(_TYPED_KEYS), _SCALAR, min_size=1, max_size=2),
    st.fixed_dictionaries(
        {"file": st.one_of(_SOME_TEXT, st.sampled_from(["/x", "{path}/x", "{sysfs}/y"]))},
        optional={"type": st.one_of(st.sampled_from(_TYPED_KEYS), _SCALAR)},
    ),
    st.lists(_SCALAR, max_size=2),
)


_DECLARED_NAME = st.one_of(
    st.sampled_from(_NAMES),
    st.builds(
        lambda domain, name: f"{domain}/{name}" if domain else name,
        st.sampled_from(["", "a.com", "gopherplug.example.com", "\u212a" * 21]),
        _SOME_TEXT,
    ),
    _SOME_TEXT,
)


_DECLARED_CASE = st.tuples(
    st.sampled_from(SECTIONS), _DECLARED_NAME, _DECLARED_VALUE, st.sampled_from(["dra", "dra", "device-plugin"])
)


def _helm_values(data):
    """``data`` as a values file Helm reads as given: JSON, every character outside ASCII's printable
    ones and the astral planes escaped (a raw one may be one Go's YAML reader refuses; an astral one
    escaped is a surrogate pair, which it refuses too)."""
    text = json.dumps(data, ensure_ascii=False)
    return re.sub(r"[\x7f-\uffff]", lambda m: f"\\u{ord(m[0]):04x}", text)


#: The ConfigMap's lines of $resource, as templates/configmap.yaml writes a resource.
_AS_CONFIGMAP_WRITES = (
    '(printf "- %s%s" (toYaml (pick $resource "name") | trim) (toYaml (omit $resource "name") | nindent 2))'
)


def _chart_verdicts(helm, tmp_path, per_case, values):
    """One `helm template` of a test chart that has the real templates/_validate.tpl and renders
    ``per_case`` (which sets $problem and $resource) for each of ``values["cases"]``: the chart's
    problem and the ConfigMap's lines of the resource (toYaml, as configmap.yaml writes them)."""
    chart = tmp_path / "verdicts"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: verdicts\nversion: 0.1.0\n")
    shutil.copy(CHART / "templates" / "_validate.tpl", chart / "templates")
    (chart / "templates" / "verdicts.yaml").write_text(
        f"{{{{- range .Values.cases }}}}\n{per_case}\n"
        f'{{{{ print "\\n" }}}}{{{{ dict "problem" $problem "yaml" {_AS_CONFIGMAP_WRITES} | toJson }}}}\n'
        "{{- end }}\n"
    )
    (tmp_path / "cases.json").write_text(_helm_values(values))
    argv = [helm, "template", "verdicts", str(chart), "-f", str(tmp_path / "cases.json")]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [json.loads(line) for line in result.stdout.split("\n") if line.startswith("{")]
    assert len(lines) == len(values["cases"])
    return lines


def _declared_verdicts(helm, tmp_path, cases):
    """For each (section, key, value, mode): the chart's problem with it (gopherplug.declaredProblem),
    and the ConfigMap's lines of the resource that declares it."""
    per_case = (
        "{{- $resource := set (deepCopy $.Values.resource) .section (dict .key .value) -}}\n"
        '{{- if eq .mode "dra" }}{{ $_ := set $resource "api" "dra" }}{{ end -}}\n'
        '{{- $problem := include "gopherplug.declaredProblem" (dict "at" "config.resources[0]" "section" .section '
        '"key" .key "value" .value "driver" (ternary "gopherplug.example.com" "" (eq .mode "dra"))) -}}'
    )
    keys = ("section", "key", "value", "mode")
    values = {"resource": _GOPHER, "cases": [dict(zip(keys, case, strict=True)) for case in cases]}
    return _chart_verdicts(helm, tmp_path, per_case, values)


def _node_verdict(mode, rendered):
    """What parse_config says of the ConfigMap with this ``rendered`` resource: None, or its refusal."""
    text = "dra: {driver: gopherplug.example.com}\n" if mode == "dra" else ""
    text += "resources:\n" + textwrap.indent(rendered, "  ") + "\n"  # the ConfigMap's file ends with a line break
    try:
        gp.parse_config(text, "config.yaml")
    except gp.ConfigError as error:
        return str(error)
    except Exception as error:  # a bug of parse_config's: the plugin would end
        return f"raises {error!r}"
    return None


def _generated_cases():
    """Cases hypothesis generates from the rules' conditions (PROPERTIES: derandomized in CI)."""
    cases = []

    @settings(PROPERTIES, database=None)
    @given(_DECLARED_CASE)
    def collect(case):
        cases.append(case)

    collect()
    return cases


@pytest.mark.slow
def test_the_chart_and_parse_config_agree_on_every_attribute_and_capacity(helm, tmp_path):
    """One rule table, two enforcers that cannot disagree: for every boundary of the attribute and
    capacity rules (and values generated around them), `helm template` refuses what parse_config
    refuses of the ConfigMap the chart would write, and takes what it takes; a refusal names the
    value's path. Both judge what the node reads: the chart's toYaml of the value Helm parsed."""
    cases = _boundary_cases() + _generated_cases()
    unique = list({json.dumps(case, sort_keys=True): case for case in cases}.values())
    disagreements = []
    for case, chart in zip(unique, _declared_verdicts(helm, tmp_path, unique), strict=True):
        section, key, _, mode = case
        node = _node_verdict(mode, chart["yaml"])
        if chart["problem"]:
            assert chart["problem"].startswith(f"config.resources[0].{section}.{key}"), chart["problem"]
        if bool(chart["problem"]) != bool(node):
            disagreements.append((case, chart["problem"], node))
    assert disagreements == [], f"{len(disagreements)} of {len(unique)} cases:\n" + "\n".join(map(repr, disagreements))


@pytest.mark.slow
def test_the_chart_counts_attributes_and_capacities_as_parse_config_does(helm, tmp_path):
    """The 32 attributes and capacities a device may have: for resources of each kind (a directory,
    USB devices), shared or not, with counts either side of the limit split between attributes and
    capacity, `helm template` refuses exactly what parse_config refuses of the ConfigMap it writes,
    and the install's notes carry check-config's warning of the attributes sysfs may add."""
    kinds = ({"directory": "/dev", "pattern": "gopher*"}, {"usb": [{"vendor": "0407", "product": "6001"}]})
    cases = []
    for where in kinds:
        for replicas in (1, 2):
            for total in range(20, 34):
                for attributes in sorted({0, 1, total // 2, total - 1, total}):
                    resource = {"name": "example.com/gopher", "api": "dra", **where, "replicas": replicas}
                    resource["attributes"] = {f"a{n}": "x" for n in range(attributes)}
                    resource["capacity"] = {f"c{n}": 1 for n in range(total - attributes)}
                    cases.append(resource)
    verdicts = {}
    for template in ("countProblem", "roomWarning"):
        per_case = (
            f'{{{{- $resource := . -}}}}{{{{- $problem := include "gopherplug.{template}" '
            '(dict "at" "config.resources[0]" "resource" .) -}}'
        )
        verdicts[template] = _chart_verdicts(helm, tmp_path / template, per_case, {"cases": cases})
    disagreements = []
    for resource, chart, warned in zip(cases, verdicts["countProblem"], verdicts["roomWarning"], strict=True):
        node = _node_verdict("dra", chart["yaml"])
        assert bool(chart["problem"]) == bool(node), (resource, chart["problem"], node)
        if node:
            assert chart["problem"] == node.removeprefix("config.yaml: ").replace("resources", "config.resources", 1)
            continue
        text = "dra: {driver: gopherplug.example.com}\nresources:\n" + textwrap.indent(chart["yaml"], "  ") + "\n"
        warnings = [w.partition(": ")[2] for w in gp.parse_config(text, "config.yaml").warnings]
        said = [f"config.{w}" for w in warnings if "sysfs" in w]
        if said != [warned["problem"]] if warned["problem"] else said:
            disagreements.append((resource, warned["problem"], said))
    assert disagreements == []


_RESOURCE_NAMES = [
    *(f"example.com/{'a' * n}" for n in (1, 63, 64)),
    *(f"{'a' * n}/x" for n in (1, 244, 245)),
    *(f"{'a.' * 121}{'a' * n}/x" for n in (1, 2, 3)),  # 243 to 245 bytes of labels
    *("example.com/gopher", "example.com/a.b_c-d", "example.com/-a", "example.com/a-", "example.com/_a", "x/y"),
    *("example.com", "example.com/", "/gopher", "a/b/c", "kubernetes.io/gpu", "a.kubernetes.io/gpu", "kubernetes.io"),
    *("requests.example.com/gpu", "requests/gpu", "Example.com/gpu", "example.com/GPU", "exa mple.com/g", "-a.com/g"),
    *("example.com/\u00e9", "\u00e9.com/g", "example.com/\u0663", "\u0663.com/g", "example.com/g\n", "a..b/g"),
    *(f"example.com/{_by_bytes(unit, 63)}" for unit in _LONG.values()),
]


_RESOURCE_NAME = st.one_of(
    st.sampled_from(_RESOURCE_NAMES),
    st.text(st.sampled_from("aZ09.-_/é\u0663k"), max_size=80),
    st.builds(lambda domain, name: f"{domain}/{name}", st.sampled_from(["a.com", "A.com", "kubernetes.io"]), _TEXT),
)


@pytest.mark.slow
def test_the_chart_and_parse_config_agree_on_every_resource_name(helm, tmp_path):
    """Resource names, each rule's edge from both sides (the name's 63, the domain's 244 with
    "requests." before it, the reserved kubernetes.io and requests., case, ASCII) and generated
    ones: `helm template` refuses exactly what parse_config refuses."""
    names = list(_RESOURCE_NAMES)

    @settings(PROPERTIES, database=None)
    @given(_RESOURCE_NAME)
    def collect(name):
        names.append(name)

    collect()
    per_case = (
        '{{- $resource := set (deepCopy $.Values.resource) "name" . -}}'
        '{{- $problem := include "gopherplug.resourceNameProblem" . -}}'
    )
    resource = {"directory": "/dev", "pattern": "gopher*", "env": "GOPHER_DEVICES"}
    names = list(dict.fromkeys(names))
    verdicts = _chart_verdicts(helm, tmp_path, per_case, {"resource": resource, "cases": names})
    disagreements = []
    for name, chart in zip(names, verdicts, strict=True):
        node = _node_verdict("device-plugin", chart["yaml"])
        if bool(chart["problem"]) != bool(node):
            disagreements.append((name, chart["problem"], node))
    assert disagreements == [], f"{len(disagreements)} of {len(names)}"


#: Resources the node takes, which between them give every key that holds a string a value (the
#: configuration's own: attributes and capacity have their own test above, the name the one before).
_EVERY_STRING_KEY = [
    {
        **_gopher(id_pattern="(?P<id>gopher[0-9]+)", env="GOPHER_DEVICES", api="device-plugin"),
        "device_specs": [{"host_path": "/dev/gopher0", "container_path": "/dev/gopher0", "permissions": "rw"}],
        "mounts": [{"host_path": "/dev/shm", "container_path": "/shm", "read_only": True}],
        "annotations": {"example.com/a": "b"},
        "pre_start": ["/bin/true", "arg"],
        "describe": ["/bin/true", "arg"],
        "allowed_host_paths": ["/run/gopher"],
        "shared_with": ["example.com/other"],
    },
    {
        "name": "example.com/key",
        "usb": [{"vendor": "1050", "product": "0407", "serial": "ABC"}],
        "cdi": {"kind": "example.com/key", "spec_dir": "/var/run/cdi"},
    },
    {"name": "example.com/m", "match": [{"directory": "/dev", "pattern": "gopher*"}], "preferred": "spread"},
]


_OTHER = {"name": "example.com/other", "directory": "/dev", "pattern": "other*", "env": "OTHER_DEVICES"}


#: Strings toYaml writes unquoted that YAML 1.1 reads as something else, and near ones it reads back.
_NOT_READ_BACK = ["=", "<<", "1.5e+999", "-1.5e+999", "1_0.5e+999", ".5E+999"]


_READ_BACK = ["=x", "<<<", "1.5e+99", "1.5e999", "1.5e-999", "x"]


def _string_leaves(value, path="", keys=()):
    """(path, keys, setter) for each string in ``value``, a resource's data: its path as the chart
    names it, the keys on the way there, and what sets it."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        at, within = (f"{path}[{key}]", keys) if isinstance(value, list) else (f"{path}.{key}", (*keys, key))
        if isinstance(item, str):
            yield at, within, functools.partial(value.__setitem__, key)
        else:
            yield from _string_leaves(item, at, within)


@pytest.mark.slow
def test_the_chart_and_parse_config_agree_on_every_string_the_configmap_carries(helm, tmp_path):
    """Every key that holds a string, not only attributes and capacity: toYaml writes "=", "<<" and a
    number past float64 unquoted, and the plugin's YAML 1.1 reads them back as tags it cannot load or
    as inf, on every node at once after a `helm upgrade` that succeeded. The chart refuses each such
    value at its path, takes the near ones that read back as written, and never takes one the node
    then refuses as YAML; the keys covered are every key parse_config knows but those of no string."""
    cases, covered = [], set()
    for index, base in enumerate(_EVERY_STRING_KEY):
        for path, keys, _ in _string_leaves(base):
            if path == ".name":
                continue
            covered.update(keys)
            for text in _NOT_READ_BACK + _READ_BACK:
                resource = copy.deepcopy(base)
                next(setter for at, _, setter in _string_leaves(resource) if at == path)(text)
                cases.append({"base": index, "path": path, "text": text, "resource": resource})
    no_string = {"replicas", "whole_dev", "allow_mounted", "read_only", "pre_start_timeout", "attributes", "capacity"}
    nested = {"serial", "vendor", "product", "host_path", "container_path", "permissions", "kind", "spec_dir"}
    assert sorted((gp._RESOURCE_KEYS - {"name"} | nested) - no_string - covered) == []
    per_case = (
        "{{- $resource := .resource -}}"
        '{{- $problem := include "gopherplug.textProblem" (dict "at" "config.resources[0]" '
        '"value" (omit .resource "name" "attributes" "capacity")) -}}'
    )
    verdicts = _chart_verdicts(helm, tmp_path, per_case, {"cases": cases})
    wrong = []
    for case, chart in zip(cases, verdicts, strict=True):
        text = "resources:\n" + textwrap.indent(chart["yaml"], "  ") + "\n"
        if case["base"] == 0:  # its shared_with names _OTHER
            text += textwrap.indent(yaml.safe_dump([_OTHER]), "  ")
        try:
            gp.parse_config(text, "config.yaml")
            node = None
        except gp.ConfigError as error:
            node = str(error)
        as_yaml = bool(node and re.search(r"invalid YAML|\binf\b", node))
        if case["text"] in _NOT_READ_BACK:
            ok = chart["problem"].startswith(f"config.resources[0]{case['path']}: '{case['text']}' is ") and node
        else:
            ok = not chart["problem"] and not as_yaml
        if not ok or (as_yaml and not chart["problem"]):
            wrong.append((case["path"], case["text"], chart["problem"], node))
    assert wrong == [], f"{len(wrong)} of {len(cases)}:\n" + "\n".join(map(repr, wrong))


@pytest.mark.parametrize(
    ("resource", "path"),
    [
        (_gopher(pattern="="), "pattern"),
        ({"name": "example.com/m", "match": [{"directory": "/dev", "pattern": "<<"}]}, "match[0].pattern"),
        (_gopher(annotations={"example.com/a": "1.5e+999"}), "annotations.example.com/a"),
        (_gopher(describe=["/bin/describe", "="]), "describe[1]"),
        (_gopher(pre_start=["/bin/reset", "1.5e+999"]), "pre_start[1]"),
        ({"name": "example.com/key", "usb": [{"vendor": "1050", "product": "0407", "serial": "<<"}]}, "usb[0].serial"),
    ],
)
def test_the_chart_refuses_a_string_the_plugin_would_read_as_something_else(helm, resource, path, tmp_path):
    """Each of these rendered, `helm upgrade` succeeded, and every node's plugin then exited 2 on the
    ConfigMap ("invalid YAML", "not inf"): the real chart refuses them at render, naming the key."""
    values = tmp_path / "values.json"
    values.write_text(_helm_values(_resources(resource)))
    result = helm_template(helm, str(values))
    assert result.returncode == 1 and f"config.resources[0].{path}: '" in result.stderr, result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("character", ["\x7f", "\x80", "\ufffe"])
def test_the_chart_refuses_a_resource_toyaml_cannot_write(helm, character, tmp_path):
    """Sprig's toYaml returns "" for what Go's YAML cannot write: configmap.yaml would give the node
    the resource's name alone (which parse_config refuses, on every node). Refused at render."""
    values = tmp_path / "values.json"
    values.write_text(_helm_values(_resources(_gopher(pattern=f"gopher{character}*"))))
    result = helm_template(helm, str(values))
    said = "config.resources[0]: has a character toYaml cannot write into the ConfigMap"
    assert result.returncode == 1 and said in result.stderr, result.stderr


@pytest.mark.slow
def test_the_chart_refuses_allowed_host_paths_it_does_not_mount(helm, tmp_path):
    """allowed_host_paths outside /dev and /sys must be mounted into the pod (extraHostPaths), or
    the plugin finds nothing there, silently: refused at render, and the same values with the
    extraHostPaths entry render."""
    resource = _gopher(
        allowed_host_paths=["/usr/lib/x86_64-linux-gnu"],
        mounts=[{"host_path": "/usr/lib/x86_64-linux-gnu/libcuda.so.1", "container_path": "/l"}],
    )
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(_resources(resource)))
    result = helm_template(helm, str(values))
    said = "config.resources[0].allowed_host_paths[0]: '/usr/lib/x86_64-linux-gnu' is not mounted into the "
    said += "plugin's pod, which would see nothing there: add it to extraHostPaths"
    assert result.returncode == 1 and said in result.stderr, result.stderr
    values.write_text(yaml.safe_dump(_resources(resource, extraHostPaths=["/usr/lib"])))
    assert helm_template(helm, str(values)).returncode == 0


@pytest.mark.parametrize(
    ("values", "said"),
    [
        ({"kubeletDir": "var/lib/kubelet"}, "kubeletDir: 'var/lib/kubelet' must be an absolute path"),
        ({"extraHostPaths": ["usr/lib"]}, "extraHostPaths[0]: 'usr/lib' must be an absolute path"),
        ({"fullnameOverride": "Gopher"}, "fullnameOverride: 'Gopher': must be a lower-case DNS label"),
        ({"apiLabel": {"value": "-dra"}}, "apiLabel.value: '-dra': must be a label value"),
        ({"podMonitor": {"interval": "30"}}, "podMonitor.interval: '30': must be a duration Prometheus reads"),
        ({"nfd": {"enabled": True, "featuresDir": "features.d"}}, "nfd.featuresDir: 'features.d' must be an absolute"),
    ],
)
def test_the_charts_own_values_are_refused_in_a_sentence(helm, values, said, tmp_path):
    """Values the chart uses itself, which its schema checked with a pattern (Helm printed the
    regex): a sentence that says what to write."""
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    result = helm_template(helm, str(path))
    assert result.returncode == 1 and f"execution error at (gopherplug/templates/configmap.yaml:1:4): {said}" in (
        result.stderr
    ), result.stderr


def test_the_charts_schema_prints_no_regex_and_no_not():
    """Helm 4 prints a failed `pattern` as the regex and a failed `not` as "'not' failed": neither
    says what to write. Those checks are the templates' (templates/_validate.tpl), as sentences."""
    schema = (CHART / "values.schema.json").read_text()

    def keys(node):
        if isinstance(node, dict):
            for key, value in node.items():
                yield key
                # The names of properties are the values' keys, not the schema's ("pattern" is one).
                for item in value.values() if key == "properties" else [value]:
                    yield from keys(item)
        elif isinstance(node, list):
            for item in node:
                yield from keys(item)

    assert {"pattern", "not", "if", "contains"} & set(keys(json.loads(schema))) == set()


@pytest.mark.slow
def test_the_charts_notes_carry_check_configs_warnings(helm, tmp_path):
    """A regex-looking pattern renders (the plugin runs), and the install's notes say what
    check-config says of it."""
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(_resources(_gopher(pattern=r"nvidia\d+"))))
    config = gp.parse_config(yaml.safe_dump(_chart_configuration(yaml.safe_load(values.read_text()))), "c")
    (warning,) = config.warnings
    argv = [helm, "install", "gopherplug", "chart/gopherplug", "-n", "kube-system", "-f", str(values)]
    result = subprocess.run([*argv, "--dry-run=client"], cwd=HERE, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    notes = result.stdout.partition("\nNOTES:\n")[2]
    assert f"config.{warning.partition(': ')[2]}" in notes.splitlines(), notes
    values.write_text(yaml.safe_dump(_resources(_gopher())))
    result = subprocess.run([*argv, "--dry-run=client"], cwd=HERE, capture_output=True, text=True, timeout=120)
    assert "check-config warns" not in result.stdout


@pytest.mark.slow
def test_the_charts_notes_warn_of_the_attributes_sysfs_may_add(helm, tmp_path):
    """A DRA resource with room for its own attributes but not for sysfs's renders (the plugin
    leaves the last by name out, with a line), and the install's notes say so, as check-config does
    (their texts are held together by the test above)."""
    values = tmp_path / "values.yaml"
    resource = _gopher(api="dra", attributes={f"a{n}": "x" for n in range(26)})
    values.write_text(yaml.safe_dump(_dra(resource)))
    argv = [helm, "install", "gopherplug", "chart/gopherplug", "-n", "kube-system", "-f", str(values)]
    result = subprocess.run([*argv, "--dry-run=client"], cwd=HERE, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    said = "config.resources[0].attributes: with the capacities and gopherplug's own, 29, and up to 4 sysfs gives "
    said += "a PCI device (NUMA node, PCI address) a device may have 33: past 32, the last by name are left out"
    assert said in result.stdout.partition("\nNOTES:\n")[2].splitlines(), result.stdout[-2000:]


@pytest.mark.slow
def test_the_chart_refuses_mode_dra_before_kubernetes_1_34(helm):
    """resource.k8s.io/v1 is served from 1.34: an older cluster gets one line saying what to do,
    not objects its API server refuses one by one. 1.34 itself renders."""
    values = "chart/gopherplug/ci/dra-values.yaml"
    old = helm_template(helm, values, "gopherplug-dra", "--kube-version", "1.33.0")
    assert old.returncode == 1 and old.stdout == "", old.stdout
    said = "mode dra needs Kubernetes 1.34 or later (resource.k8s.io/v1); this cluster is v1.33.0: "
    said += "use mode device-plugin"
    assert said in old.stderr, old.stderr
    assert helm_template(helm, values, "gopherplug-dra", "--kube-version", "1.34.0").returncode == 0


@pytest.mark.slow
def test_ci_helm_refuses_a_cached_binary_that_is_not_the_one_it_checks(helm, tmp_path):
    """.ci/helm uses a cached helm only when its sha256 is the one written in the script: a binary
    put in its place is replaced by the checked one, fetched again."""
    (tmp_path / "helm").write_text("#!/bin/sh\necho 'not helm'\n")
    (tmp_path / "helm").chmod(0o755)
    env = {**os.environ, "PYTHON": sys.executable, "GOPHERPLUG_HELM_CACHE": str(tmp_path)}
    result = subprocess.run(
        [str(HERE / ".ci" / "helm")], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert (result.returncode, result.stdout) == (0, f"{tmp_path / 'helm'}\n"), result.stderr
    wanted = re.search(r"^HELM_SHA256=([0-9a-f]{64})$", (HERE / ".ci" / "helm").read_text(), re.M)
    assert wanted is not None
    assert hashlib.sha256((tmp_path / "helm").read_bytes()).hexdigest() == wanted[1]
    version = subprocess.run([str(tmp_path / "helm"), "version", "--short"], capture_output=True, text=True, timeout=60)
    assert version.stdout.startswith("v4.3.1+"), version.stdout + version.stderr


def test_shipped_files_stand_alone():
    # Users get the repository, not the team's design notes: the product states facts itself or
    # names upstream sources by repository and path.
    tracked = subprocess.run(["git", "ls-files"], cwd=HERE, capture_output=True, text=True, check=False).stdout.split()
    shipped = tracked or [p.name for p in HERE.iterdir() if p.is_file()]  # not a git checkout: the top level
    for name in shipped:
        path = HERE / name
        if path.suffix in {".py", ".md", ".toml", ".yaml", ".proto", ".go", ""} and path.is_file():
            text = path.read_text(encoding="utf-8", errors="replace")
            if name == ".ci/run":  # CI, not the product: it sets the runtime tier up with the script beside the clone
                text = re.sub(r"\.\./shared/runtime/setup\.sh", "", text)
            assert not re.search(r"DESIGN(\.md| §)|\.\./shared/", text), f"{name} cites the team's notes"
