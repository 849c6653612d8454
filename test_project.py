"""The project's own checks: ruff, mypy, the lock, the manifests."""

from __future__ import annotations

import re
import subprocess

import pytest
import yaml

import gopherplug as gp
from testsupport import (
    HERE,
    check,
)

# ------------------------------------------------------------------------------------------------
# The project's own checks: lint and types, the image and the manifest
# ------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv",
    [("ruff", "check", "."), ("ruff", "format", "--check", "."), ("mypy",)],
    ids=["ruff-check", "ruff-format", "mypy"],
)
def test_code_is_lint_and_type_clean(argv):
    result = check(*argv)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("dockerfile", ["Dockerfile", "examples/distroless/Dockerfile", ".ci/distroless-python"])
def test_dockerfile_passes_hadolint(dockerfile):
    result = check("hadolint", dockerfile)
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


RELEASE_WORKFLOW = HERE / ".github" / "workflows" / "release.yml"


@pytest.mark.slow
def test_the_release_workflow_is_valid_against_githubs_workflow_schema(tmp_path):
    result = check("check-jsonschema", "--builtin-schema", "vendor.github-workflows", str(RELEASE_WORKFLOW))
    assert result.returncode == 0, result.stdout + result.stderr
    # The check bites: a job with its steps misspelt is refused.
    broken = tmp_path / "release.yml"
    broken.write_text(RELEASE_WORKFLOW.read_text().replace("    steps:\n", "    stepz:\n", 1))
    result = check("check-jsonschema", "--builtin-schema", "vendor.github-workflows", str(broken))
    assert result.returncode == 1, result.stdout + result.stderr


@pytest.mark.slow
def test_the_version_is_the_same_everywhere():
    """__version__ is the one place the version is written: the image tags of both manifests and the
    examples in the Dockerfile, the README and docs/deployment.md say the same, as do the chart's version and
    appVersion (the images' default tag), and the release workflow's check that the tag names it
    reads that very value."""
    found = {
        name: re.findall(r"gopherplug:(\d+\.\d+\.\d+\S*)", (HERE / name).read_text())
        for name in ("Dockerfile", "daemonset.yaml", "daemonset-dra.yaml", "README.md", "docs/deployment.md")
    }
    assert all(found.values()), found
    tags = {tag.split("-")[0].rstrip("`.") for tags in found.values() for tag in tags}
    assert tags == {gp.__version__}, found
    chart = yaml.safe_load((HERE / "chart" / "gopherplug" / "Chart.yaml").read_text())
    assert (chart["version"], chart["appVersion"]) == (gp.__version__, gp.__version__), chart  # the images' tag
    step = RELEASE_WORKFLOW.read_text().split("version=$(", 1)[1].split(")\n", 1)[0]
    result = subprocess.run(["sh", "-c", step], cwd=HERE, capture_output=True, text=True, timeout=60, check=False)
    assert (result.returncode, result.stdout, result.stderr) == (0, f"{gp.__version__}\n", "")


@pytest.mark.slow
def test_daemonset_is_valid_against_the_kubernetes_schema():
    result = check("kubernetes-validate", "--strict", "daemonset.yaml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("passed") == 2  # the ConfigMap and the DaemonSet


def test_daemonset_runs_least_privileged_with_the_probe():
    with open(HERE / "daemonset.yaml", encoding="utf-8") as file:
        config_map, daemon_set = yaml.safe_load_all(file)
    gp.parse_config(config_map["data"]["config.yaml"], "daemonset.yaml ConfigMap")
    pod = daemon_set["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert pod["priorityClassName"] == "system-node-critical"
    host_paths = {volume["name"]: volume.get("hostPath", {}).get("path") for volume in pod["volumes"]}
    mounts = {mount["mountPath"]: mount for mount in container["volumeMounts"]}
    assert host_paths[mounts["/var/lib/kubelet/device-plugins"]["name"]] == "/var/lib/kubelet/device-plugins"
    for path in ("/dev", "/sys"):
        assert (host_paths[mounts[path]["name"]], mounts[path]["readOnly"]) == (path, True)
    # The plugin must see each device at its host path: every configured directory is a host
    # directory mounted at the same path.
    for resource in gp.parse_config(config_map["data"]["config.yaml"]).resources:
        covering = [p for p in mounts if gp._is_under(resource.directory, [p]) and host_paths[mounts[p]["name"]] == p]
        assert covering, f"{resource.directory} is not a host directory mounted at the same path"


@pytest.mark.parametrize("manifest", ["daemonset.yaml", "daemonset-dra.yaml"])
def test_the_manifests_create_no_device_directory_on_the_nodes(manifest):
    """A DaemonSet lands on every node: the example's device directory, a DirectoryOrCreate volume,
    made an empty /etc/gophers on each. The volume of every directory the configuration names must
    be there already (type Directory: the pod waits, with an event, where it is not); only the
    kubelet's and the container runtime's own directories may be created."""
    docs = {doc["kind"]: doc for doc in yaml.safe_load_all((HERE / manifest).read_text()) if doc}
    config = gp.parse_config(docs["ConfigMap"]["data"]["config.yaml"], f"{manifest} ConfigMap")
    pod = docs["DaemonSet"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    host_paths = {volume["name"]: volume["hostPath"] for volume in pod["volumes"] if "hostPath" in volume}
    created = {v["path"] for v in host_paths.values() if v.get("type") in ("DirectoryOrCreate", "FileOrCreate")}
    driver = f"/var/lib/kubelet/plugins/{config.dra.driver}" if config.dra else None
    assert created <= {"/var/lib/kubelet/plugins_registry", driver, "/var/run/cdi"}
    for source in (source for resource in config.resources for source in resource.sources):
        mounted = [m for m in container["volumeMounts"] if gp._is_under(source.directory, [m["mountPath"]])]
        mount = max(mounted, key=lambda m: len(m["mountPath"]))
        assert host_paths[mount["name"]].get("type") == "Directory", (source.directory, host_paths[mount["name"]])


@pytest.mark.parametrize("manifest", ["daemonset.yaml", "daemonset-dra.yaml"])
def test_the_manifests_mount_dev_and_sys_recursively_read_only_and_the_cdi_directory_only_where_used(manifest):
    """/dev and /sys read-only with the mounts beneath them (recursiveReadOnly: IfPossible, which
    the API server accepts only with readOnly and no propagation). The CDI spec directory is
    mounted, read-write and made where missing, exactly when a resource of the shipped
    configuration has `cdi:` (every DRA resource does): the device-plugin example has none, so
    its DaemonSet creates no /var/run/cdi on the nodes."""
    docs = {doc["kind"]: doc for doc in yaml.safe_load_all((HERE / manifest).read_text()) if doc}
    config = gp.parse_config(docs["ConfigMap"]["data"]["config.yaml"], f"{manifest} ConfigMap")
    pod = docs["DaemonSet"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    mounts = {mount["mountPath"]: mount for mount in container["volumeMounts"]}
    for path in ("/dev", "/sys"):
        assert mounts[path]["readOnly"] is True and mounts[path]["recursiveReadOnly"] == "IfPossible", path
        assert mounts[path].get("mountPropagation", "None") == "None", path
    assert [m for m in mounts.values() if "recursiveReadOnly" in m and not m.get("readOnly")] == []
    host_paths = {volume["name"]: volume["hostPath"] for volume in pod["volumes"] if "hostPath" in volume}
    spec_dirs = {resource.cdi.spec_dir for resource in config.resources if resource.cdi is not None}
    assert spec_dirs == ({"/var/run/cdi"} if manifest == "daemonset-dra.yaml" else set())
    cdi_mounts = {path for path in mounts if path in spec_dirs or "cdi" in path}
    assert cdi_mounts == spec_dirs
    for path in spec_dirs:
        assert not mounts[path].get("readOnly") and host_paths[mounts[path]["name"]] == {
            "path": path,
            "type": "DirectoryOrCreate",
        }
    assert [v["path"] for v in host_paths.values() if "cdi" in v["path"]] == sorted(spec_dirs)
