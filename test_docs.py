"""The documentation: README.md and docs/, true to the code."""

from __future__ import annotations

import dataclasses
import os
import re
import sys

import pytest
import trio
import trio.socket
import trio.testing
import yaml

import gopherplug as gp
from gopherplug import v1beta1
from testsupport import (
    DRIVER,
    HERE,
    OTHER,
    RESOURCE,
    TIMEOUT,
    YUBIKEY,
    DraNode,
    _free_loopback_port,
    _healthz,
    _scrape,
    claim,
    config_text,
    config_with,
    dra_config,
    listed,
    lock,
    logged,
    nothing_found,
    reloading,
    replace_file,
    start,
    streaming,
)

# The documentation: README.md, a ten-minute read, and the reference in docs/.

DOCS = sorted(str(path.relative_to(HERE)) for path in (HERE / "docs").glob("*.md"))


def github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub makes for a page's headings: the heading's text without its markup,
    lower-cased, every character but letters, digits, "_", "-" and spaces dropped, spaces made
    "-"; a repeated one gets -1, -2, ... (github-slugger, which github.com follows). Headings in
    fenced code blocks are not headings."""
    anchors: set[str] = set()
    fenced = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        heading = re.match(r"#{1,6} (.*)", line)
        if fenced or heading is None:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(1)).strip().lower()  # a link: its text
        slug = re.sub(r"[^\w\- ]", "", text.replace("`", "")).replace(" ", "-")
        anchor, n = slug, 0
        while anchor in anchors:
            n += 1
            anchor = f"{slug}-{n}"
        anchors.add(anchor)
    return anchors


def test_every_relative_link_and_anchor_of_the_docs_resolves():
    """README.md and docs/*.md link each other by relative paths and heading anchors: each link
    names a file or directory of the repository, and each #anchor a heading of its page (or of
    the page it is on), so that a section moved or renamed fails here rather than on GitHub."""
    assert {"docs/configuration.md", "docs/dra.md", "docs/embedding.md", "docs/operations.md"} <= set(DOCS)
    broken, checked = [], 0
    for name in ["README.md", *DOCS]:
        page = HERE / name
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)  # code is not links
        text = re.sub(r"`[^`\n]*`", "", text)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            checked += 1
            if not linked.exists() or HERE not in (linked, *linked.parents):
                broken.append(f"{name}: {target}: no such file in the repository")
            elif anchor and anchor not in github_anchors(linked.read_text()):
                broken.append(f"{name}: {target}: no heading #{anchor} in {linked.relative_to(HERE)}")
    assert not broken, "\n".join(broken)
    assert checked > 40, checked


def test_github_anchors_follow_githubs_rules():
    page = "# A `serve_devices` page\n## inotify's limits\n```\n# not a heading\n```\n## Sharing\n## Sharing\n"
    assert github_anchors(page) == {"a-serve_devices-page", "inotifys-limits", "sharing", "sharing-1"}


def _accepted_keys(config: dict[str, object], where: str) -> set[str]:
    """The keys the parser accepts at `where`, read from its own "unknown key" error."""
    with pytest.raises(gp.ConfigError) as caught:
        gp.parse_config(yaml.safe_dump(config), "t.yaml")
    assert caught.value.key_path == f"{where}.zzz".lstrip("."), caught.value
    return set(caught.value.problem.split("expected one of ", 1)[1].split(", "))


def test_readme_configuration_table_lists_every_key_the_parser_accepts():
    """Each key of the top level, of `dra` and of a resource has its own row in
    docs/configuration.md's table; the keys of the nested mappings (cdi, usb, match, device_specs, mounts)
    are named in their parent's row. The key sets come from the parser, so a new key fails here
    until it is documented."""
    readme = (HERE / "docs" / "configuration.md").read_text()
    table = readme.split("## The file", 1)[1].split("\n## ", 1)[0]
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `([^`]+)` \|(.*)$", table, re.MULTILINE)}
    resource = {"name": "example.com/g", "directory": "/dev/g"}
    top = _accepted_keys({"zzz": 1, "resources": [resource]}, "")
    dra = _accepted_keys({"dra": {"zzz": 1}, "resources": [resource]}, "dra")
    per_resource = _accepted_keys({"resources": [{**resource, "zzz": 1}]}, "resources[0]")
    assert {"device_plugin_dir", "dra", "resources", "api"} <= top | per_resource
    assert {"driver", "kubelet_dir"} <= dra
    for key in top:
        assert key in rows, f"docs/configuration.md's table lacks {key}"
    for key in dra:
        assert f"dra.{key}" in rows, f"docs/configuration.md's table lacks dra.{key}"
    for key in per_resource:
        assert f"resources[].{key}" in rows, f"docs/configuration.md's table lacks resources[].{key}"
    nested = {
        "cdi": {"cdi": {"kind": "example.com/g", "zzz": 1}},
        "usb": {"usb": [{"vendor": "1234", "product": "5678", "zzz": 1}], "directory": None},
        "match": {"match": [{"directory": "/dev/g", "zzz": 1}], "directory": None},
        "device_specs": {"device_specs": [{"host_path": "/dev/g/{id}", "container_path": "/dev/g", "zzz": 1}]},
        "mounts": {"mounts": [{"host_path": "/dev/g/{id}", "container_path": "/g", "zzz": 1}]},
    }
    for parent, fields in nested.items():
        entry = {k: v for k, v in {**resource, **fields}.items() if v is not None}
        where = f"resources[0].{parent}" + ("[0]" if isinstance(fields[parent], list) else "")
        for key in _accepted_keys({"resources": [entry]}, where):
            assert re.search(rf"\b{key}\b", rows[f"resources[].{parent}"]), f"resources[].{parent} row lacks {key}"


def test_readme_generic_device_plugin_configurations_are_valid():
    """The "Coming from generic-device-plugin" section: each gopherplug configuration beside a
    generic-device-plugin one parses, and the id_pattern its table suggests pairs a sound card's
    control and capture nodes as one device."""
    readme = (HERE / "docs" / "generic-device-plugin.md").read_text()
    section = readme.split("\n## ", 1)[0]
    blocks = re.findall(r"```yaml\n(.*?)```", section, re.DOTALL)
    theirs, ours = blocks[0::2], blocks[1::2]
    assert len(theirs) == len(ours) == 3
    for their, our in zip(theirs, ours, strict=True):
        device = yaml.safe_load(their)
        (resource,) = gp.parse_config(our, "docs/generic-device-plugin.md").resources
        assert resource.name == f"squat.ai/{device['name']}"
        count = device["groups"][0].get("count", 1)
        assert resource.replicas == count
    pattern = re.search(r'`"(\[a-z\]\+\(\?P<id>[^`]*)"`', section).group(1)
    ids = {name: re.fullmatch(pattern, name).group("id") for name in ("controlC0", "pcmC0D0c", "controlC1")}
    assert ids == {"controlC0": "C0", "pcmC0D0c": "C0", "controlC1": "C1"}


def test_dra_extra_messages_say_how_to_install_from_a_checkout(monkeypatch):
    """gopherplug is on no package index: the message for a missing dra extra says to install it
    from a checkout, and nothing tells a user to `pip install 'gopherplug[dra]'`."""
    monkeypatch.setitem(sys.modules, "lightkube", None)  # import lightkube raises ImportError
    with pytest.raises(gp.GopherplugError, match=re.escape("pip install '.[dra]' in a checkout")):
        trio.run(gp.run_dra_demo, lambda line: None)
    for name in ("README.md", *DOCS, "config.example.yaml", "gopherplug.py"):
        assert "pip install 'gopherplug[" not in (HERE / name).read_text(), name


def _samples(page):
    """The page's samples, name{labels} -> value, without the comment lines."""
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in page.splitlines()
        if line and not line.startswith("#")
    }


async def test_metrics_served_over_http_count_devices_registrations_and_allocations(nursery, node):
    port = _free_loopback_port()
    with trio.fail_after(TIMEOUT), logged("registered with the kubelet as") as registered:
        simulator = await start(nursery, node, top={"metrics_address": f"127.0.0.1:{port}"})
        await simulator.allocate(RESOURCE, ["g1"])
        await simulator.allocate(RESOURCE, ["g2"])
        await registered.wait()  # counted once Register's answer is back, maybe after the kubelet's first list
        samples = _samples(await _scrape(port))
    assert samples[f'gopherplug_devices{{health="Healthy",resource="{RESOURCE}"}}'] == 2
    assert samples[f'gopherplug_devices{{health="Unhealthy",resource="{RESOURCE}"}}'] == 0
    assert samples[f'gopherplug_registrations_total{{resource="{RESOURCE}"}}'] == 1
    assert samples[f'gopherplug_allocate_seconds_count{{resource="{RESOURCE}"}}'] == 2
    assert samples[f'gopherplug_list_and_watch_sends_total{{resource="{RESOURCE}"}}'] >= 1
    assert samples["gopherplug_kubelet_restarts_total"] == 0


async def test_metrics_off_by_default_and_stopped_with_the_plugin(node):
    port = _free_loopback_port()
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            await start(nursery, node, top={"metrics_address": f"127.0.0.1:{port}"})
            assert gp._metrics is not None
            nursery.cancel_scope.cancel()
    assert gp._metrics is None
    with pytest.raises(OSError):  # the server went with the plugin: connection refused
        await _scrape(port)
    assert node.config().metrics_address is None


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("9400", "'9400' is not host:port"),
        ("localhost:http", "'localhost:http' is not host:port"),
        ("0.0.0.0:70000", "'0.0.0.0:70000' is not host:port"),
        ("::1:9400", "write an IPv6 address in brackets"),
    ],
)
def test_metrics_address_mistake_is_one_config_error(value, problem):
    with pytest.raises(gp.ConfigError) as caught:
        config_with(top={"metrics_address": value}, directory="/dev/g")
    assert caught.value.key_path == "metrics_address"
    assert problem in str(caught.value)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("given", "env", "named"),
    [
        (["--metrics-address", "9400"], "127.0.0.1:9400", "--metrics-address"),  # the flag wins over the env
        (["--metrics-address=9400"], None, "--metrics-address"),
        ([], "9400", "GOPHERPLUG_METRICS_ADDRESS"),
    ],
)
@pytest.mark.parametrize("command", ["serve", "check-config"])  # check-config: what serve would refuse
def test_metrics_address_flag_mistake_is_one_line(tmp_path, capsys, monkeypatch, given, env, named, command):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"resources": [{"name": RESOURCE, "directory": str(tmp_path)}]}))
    if env is not None:
        monkeypatch.setenv("GOPHERPLUG_METRICS_ADDRESS", env)
    assert gp.main([command, "--config", str(config), *given]) == gp.EXIT_USAGE
    assert capsys.readouterr().err == (
        f'gopherplug: {named}: \'9400\' is not host:port, e.g. "0.0.0.0:9400" (all addresses) or "127.0.0.1:9400"\n'
    )


async def test_metrics_without_the_extra_say_how_to_install_it(node, monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import prometheus_client raises ImportError
    with trio.fail_after(TIMEOUT), pytest.raises(gp.GopherplugError) as caught, gp._unwrap_single_errors():
        async with trio.open_nursery() as nursery:
            await nursery.start(gp.serve_plugin, node.config(top={"metrics_address": "127.0.0.1:0"}))
    line = str(gp._innermost(caught.value))
    assert line.startswith("metrics_address needs prometheus_client (")
    assert line.endswith("install gopherplug with its metrics extra, pip install '.[metrics]' in a checkout")
    assert gp._metrics is None


@pytest.mark.parametrize("manifest", ["daemonset.yaml", "daemonset-dra.yaml"])
def test_daemonsets_serve_metrics_on_their_named_port_and_the_podmonitor_scrapes_it(manifest):
    """Each shipped DaemonSet turns metrics on at the container port named `metrics`, and the
    PodMonitor example (a CRD kind, which kubernetes-validate cannot check) selects its pods in
    its namespace by that port's name."""
    docs = {doc["kind"]: doc for doc in yaml.safe_load_all((HERE / manifest).read_text()) if doc}
    config = gp.parse_config(docs["ConfigMap"]["data"]["config.yaml"], f"{manifest} ConfigMap")
    assert config.metrics_address is not None
    host, _, port = config.metrics_address.rpartition(":")
    assert host == "0.0.0.0"  # the pod's own network: every address of the pod
    pod = docs["DaemonSet"]["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert {"name": "metrics", "containerPort": int(port), "protocol": "TCP"} in container["ports"]
    assert not pod["spec"].get("hostNetwork")  # else the two DaemonSets' ports would be the node's
    monitor = yaml.safe_load((HERE / "examples" / "monitoring" / "podmonitor.yaml").read_text())
    assert (monitor["apiVersion"], monitor["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")
    assert docs["DaemonSet"]["metadata"]["namespace"] in monitor["spec"]["namespaceSelector"]["matchNames"]
    (expression,) = monitor["spec"]["selector"]["matchExpressions"]
    assert pod["metadata"]["labels"][expression["key"]] in expression["values"]
    assert [endpoint["port"] for endpoint in monitor["spec"]["podMetricsEndpoints"]] == ["metrics"]


async def test_liveness_check_fails_once_our_socket_is_wiped_and_passes_once_registered_again(nursery, node):
    """GET /healthz: 200 while registered with the running kubelet; a kubelet that restarted and
    holds off (its new kubelet.sock not there yet: registration cannot succeed) fails it at the next
    check, the kubelet's stand-in wiped our socket meanwhile; registered again, it passes."""
    port = _free_loopback_port()
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node, top={"health_address": f"127.0.0.1:{port}"})
        assert await _healthz(port) == (200, "ok\n")
        hold = trio.Event()
        with logged("waiting for the kubelet: no") as waiting:
            simulator.restart(hold=hold)
            await waiting.wait()  # our socket served anew, the kubelet's sockets wiped, no kubelet.sock
        code, said = await _healthz(port)
        assert code == 503
        assert said == f"{RESOURCE}: not registered with the kubelet, which is not running (no {node.kubelet_socket})\n"
        hold.set()
        await simulator.wait_until(lambda s: s.registered_in == [1, 2] and listed("g1", "g2")(s))
        assert await _healthz(port) == (200, "ok\n")


@pytest.mark.slow
async def test_liveness_check_fails_when_the_kubelet_stops_or_a_new_one_does_not_take_the_registration(
    nursery, node, monkeypatch
):
    """Our socket left alone: the kubelet stops (kubelet.sock goes), then a new kubelet.sock is made
    by one that never answers Register (it takes the connection and says nothing). The registration
    we hold is the old kubelet's: the check fails at once, with the reason, and goes on failing
    while registering cannot succeed."""
    monkeypatch.setattr(gp, "REGISTER_TIMEOUT", 0.5)  # the silent kubelet's Register times out soon
    port = _free_loopback_port()
    with trio.fail_after(TIMEOUT):
        kubelet_scope = trio.CancelScope()

        async def kubelet(*, task_status):
            with kubelet_scope:
                await gp.KubeletSimulator(node.plugin_dir).run(task_status=task_status)

        simulator = await nursery.start(kubelet)
        await nursery.start(gp.serve_plugin, node.config(top={"health_address": f"127.0.0.1:{port}"}))
        await simulator.wait_until(listed("g1", "g2"))
        assert await _healthz(port) == (200, "ok\n")
        kubelet_scope.cancel()  # kubelet.sock goes with it; our socket stays
        await trio.testing.wait_all_tasks_blocked()
        assert not os.path.exists(node.kubelet_socket)
        stopped = await _healthz(port)
        assert len(node.our_sockets()) == 1  # not wiped: the registration is what is missing
        silent = trio.socket.socket(trio.socket.AF_UNIX)
        with silent, logged("registration failed") as failed:
            await silent.bind(node.kubelet_socket)
            silent.listen(8)  # a connection is taken into the backlog, and never answered
            await failed.wait()  # Register timed out
            refused = await _healthz(port)
    assert stopped == (503, f"{RESOURCE}: the kubelet it registered with stopped (no {node.kubelet_socket})\n")
    assert refused == (503, f"{RESOURCE}: not registered with the kubelet\n")


async def test_liveness_check_of_a_resource_compares_kubelet_generations_read_from_inotify_now(nursery, node):
    """StreamStatus.problem, each reason in turn, on real files: a kubelet.sock made anew since the
    registration fails the check at once (inotify's queue is read by the check itself, not when the
    event loop gets to it), as does our socket deleted; registered but never streamed fails after
    the grace, as `gopherplug probe` does."""
    first = trio.socket.socket(trio.socket.AF_UNIX)
    await first.bind(node.kubelet_socket)
    with trio.fail_after(TIMEOUT):
        kubelet = gp.KubeletWatch(node.plugin_dir)
        await nursery.start(kubelet.run)
        ours = os.path.join(node.plugin_dir, "gopherplug-example.com_gopher-1.sock")
        server = await nursery.start(gp.serve_grpc, ours, [])
        status = gp.StreamStatus()
        assert status.problem(kubelet) == "not serving yet"
        status.server = server
        assert status.problem(kubelet) == "not registered with the kubelet"
        status.registered, status.registered_with = True, kubelet.current()
        assert status.problem(kubelet) == ""
        unstreamed = "registered, but the kubelet has opened no ListAndWatch stream for 0 s"
        assert status.problem(kubelet, grace=-1) == unstreamed
        status.streams = 1
        assert status.problem(kubelet, grace=-1) == ""
        first.close()
        os.unlink(node.kubelet_socket)
        second = trio.socket.socket(trio.socket.AF_UNIX)
        with second:
            await second.bind(node.kubelet_socket)  # no checkpoint: the check runs before KubeletWatch's task
            restarted = status.problem(kubelet)
            os.unlink(ours)
            deleted = status.problem(kubelet)
    assert restarted == "the kubelet restarted since it registered: not registered with the one running now"
    assert deleted == f"its socket {ours} was deleted or replaced (serving it again)"


async def test_liveness_check_answers_only_its_paths_and_methods_and_stops_with_the_plugin(node):
    port = _free_loopback_port()
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            await start(nursery, node, top={"health_address": f"127.0.0.1:{port}"})
            assert await _healthz(port, "/livez?verbose") == (200, "ok\n")
            assert await _healthz(port, "/healthz", "HEAD") == (200, "")
            assert await _healthz(port, "/metrics") == (404, "not found: ask /healthz\n")
            assert await _healthz(port, "/healthz", "POST") == (405, "only GET and HEAD\n")
            nursery.cancel_scope.cancel()
        with pytest.raises(OSError):  # the listener went with the plugin: connection refused
            await _healthz(port)


def test_health_answer_says_each_failing_check_on_its_own_line():
    health = gp.Health()
    request = b"GET /healthz HTTP/1.1\r\n\r\n"
    with health.check("a", lambda: ""), health.check("b", lambda: "lost"), health.check("c", lambda: 1 / 0):
        answer = gp.health_answer(health, request)
    assert answer.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
    assert answer.endswith(b"\r\n\r\nb: lost\nc: the check failed: division by zero\n")
    assert gp.health_answer(health, request).endswith(b"\r\n\r\nok\n")  # the checks went with their blocks
    assert gp.health_answer(health, b"hello\r\n\r\n").startswith(b"HTTP/1.1 400 ")


@pytest.mark.parametrize(
    ("value", "problem"),
    [("9402", "'9402' is not host:port, e.g. \"0.0.0.0:9402\""), ("::1:9402", "write an IPv6 address in brackets")],
)
def test_health_address_mistake_is_one_config_error(value, problem):
    with pytest.raises(gp.ConfigError) as caught:
        config_with(top={"health_address": value}, directory="/dev/g")
    assert caught.value.key_path == "health_address"
    assert problem in str(caught.value)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("manifest", ["daemonset.yaml", "daemonset-dra.yaml"])
def test_daemonsets_liveness_probe_asks_the_health_port_the_config_serves(manifest):
    """The shipped liveness probe is the kubelet's httpGet of /healthz on the container port named
    `health`, which is the ConfigMap's health_address port, on every address of the pod."""
    docs = {doc["kind"]: doc for doc in yaml.safe_load_all((HERE / manifest).read_text()) if doc}
    config = gp.parse_config(docs["ConfigMap"]["data"]["config.yaml"], f"{manifest} ConfigMap")
    assert config.health_address is not None
    host, _, port = config.health_address.rpartition(":")
    assert host == "0.0.0.0"
    (container,) = docs["DaemonSet"]["spec"]["template"]["spec"]["containers"]
    assert {"name": "health", "containerPort": int(port), "protocol": "TCP"} in container["ports"]
    probe = container["livenessProbe"]
    assert probe["httpGet"] == {"path": "/healthz", "port": "health"}
    assert probe["httpGet"]["path"] in gp.HEALTH_PATHS
    assert "exec" not in probe


def test_images_install_the_metrics_extra_the_daemonsets_use():
    """Each image installs from its hashed lock, which holds the extras its DaemonSet turns on."""
    installs = re.findall(r"--require-hashes --no-deps -r (requirements/\S+)", (HERE / "Dockerfile").read_text())
    assert installs == ["requirements/device-plugin.lock", "requirements/dra.lock"], installs
    assert "prometheus-client" in lock("device-plugin.lock")
    assert {"prometheus-client", "lightkube"} <= lock("dra.lock").keys()


async def test_metrics_count_kubelet_restarts_pre_start_and_rescans(nursery, node):
    port = _free_loopback_port()
    pre_start = [sys.executable, "-c", "pass"]
    with trio.fail_after(TIMEOUT), logged("registered with the kubelet as") as registered:
        simulator = await start(nursery, node, top={"metrics_address": f"127.0.0.1:{port}"}, pre_start=pre_start)
        await gp.call_unary(
            os.path.join(node.plugin_dir, simulator.registrations[0].endpoint),
            gp.METHODS["/v1beta1.DevicePlugin/PreStartContainer"],
            v1beta1.PreStartContainerRequest(devices_ids=["g1"]),
            timeout=TIMEOUT,
        )
        simulator.restart()
        # Counted once Register's answer is back, which can be after the kubelet's first list.
        await registered.wait(2)
        moved = node.devices + ".away"  # the directory gone, then back: each time a rescan
        os.rename(node.devices, moved)
        await simulator.wait_until(listed())
        os.rename(moved, node.devices)
        await simulator.wait_until(listed("g1", "g2"))
        samples = _samples(await _scrape(port))
    assert samples[f'gopherplug_pre_start_container_seconds_count{{resource="{RESOURCE}"}}'] == 1
    assert samples["gopherplug_kubelet_restarts_total"] == 1
    assert samples[f'gopherplug_registrations_total{{resource="{RESOURCE}"}}'] == 2
    assert samples["gopherplug_rescans_total"] >= 2
    assert samples["gopherplug_inotify_overflows_total"] == 0


@pytest.mark.slow
async def test_metrics_of_a_dra_driver_count_prepares_and_api_errors_per_pool(dra_node):
    port = _free_loopback_port()
    (dra_node.devices / "gopher0").touch()
    dra_node.api.put_claim(claim("c1", "uid-1", ("gopher", DRIVER, DraNode.POOL, "gopher0")))
    config = dataclasses.replace(dra_node.config(), metrics_address=f"127.0.0.1:{port}")
    with trio.fail_after(TIMEOUT):
        await dra_node.start(config)
        await dra_node.registered()
        await dra_node.wait_for_slices(["gopher0"])
        dra_node.api.fail("update", gp.dra_slice_name("node-1", DRIVER, RESOURCE, 0), 500)
        (dra_node.devices / "gopher1").touch()
        await dra_node.wait_for_slices(["gopher0", "gopher1"])  # refused once, then written
        answer = await dra_node.kubelet.prepare(DRIVER, [("default", "uid-1", "c1")])
        samples = _samples(await _scrape(port))
    assert answer.claims["uid-1"].error == ""
    assert samples["gopherplug_node_prepare_resources_seconds_count"] == 1
    assert samples[f'gopherplug_api_errors_total{{pool="{DraNode.POOL}"}}'] == 1
    assert samples[f'gopherplug_devices{{health="Healthy",resource="{RESOURCE}"}}'] == 2


def _about(samples, value):
    """The samples with a label of this value (a resource's name, a pool's)."""
    return {name: number for name, number in samples.items() if f'="{value}"' in name}


async def test_metrics_of_a_resource_with_no_device_are_there_at_0(nursery, node, tmp_path):
    """Issue: an unplugged USB key's resource had no gopherplug_devices line, so an alert on == 0
    never fired. Every series of a resource is there from its start, at 0 until it counts."""
    port = _free_loopback_port()
    config = nothing_found(node, tmp_path, top={"metrics_address": f"127.0.0.1:{port}"})
    with trio.fail_after(TIMEOUT), logged("registered with the kubelet as") as registered:
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        await nursery.start(gp.serve_plugin, config)
        await simulator.wait_until(lambda s: streaming(s, RESOURCE) == {} and streaming(s, YUBIKEY) == {})
        await registered.wait(2)  # and counted: the kubelet may list before Register's answer is back
        samples = _samples(await _scrape(port))
    for name in (RESOURCE, YUBIKEY):
        assert samples[f'gopherplug_devices{{health="Healthy",resource="{name}"}}'] == 0
        assert samples[f'gopherplug_devices{{health="Unhealthy",resource="{name}"}}'] == 0
        assert samples[f'gopherplug_registrations_total{{resource="{name}"}}'] == 1
        assert samples[f'gopherplug_list_and_watch_sends_total{{resource="{name}"}}'] >= 1
        assert samples[f'gopherplug_allocate_seconds_count{{resource="{name}"}}'] == 0
        assert samples[f'gopherplug_pre_start_container_seconds_count{{resource="{name}"}}'] == 0


@pytest.mark.slow
async def test_metrics_of_a_removed_resource_go_with_it_and_the_others_stay(nursery, node, tmp_path):
    """Issue: after a reload removed a resource, /metrics still showed its devices. Every series
    labelled with its name goes with it; the other resources' stay as they were."""
    port = _free_loopback_port()
    path = tmp_path / "gopherplug.yaml"

    def text(**resources):
        return yaml.safe_dump(
            {**yaml.safe_load(config_text(node, **resources)), "metrics_address": f"127.0.0.1:{port}"}
        )

    path.write_text(text(**{RESOURCE: {}, OTHER: {"pre_start": [sys.executable, "-c", "pass"]}}))
    with trio.fail_after(TIMEOUT), logged("registered with the kubelet as") as registered:
        simulator = await reloading(nursery, node, path)
        await simulator.wait_until(lambda s: streaming(s, OTHER) == {"g1": gp.HEALTHY, "g2": gp.HEALTHY})
        await registered.wait(2)  # and counted
        await simulator.allocate(OTHER, ["g1"])
        await simulator.pre_start_container(OTHER, ["g1"])
        await simulator.allocate(RESOURCE, ["g2"])
        before = _samples(await _scrape(port))
        with logged("configuration reloaded: ") as reloaded:
            replace_file(path, text(**{RESOURCE: {}}))
            await reloaded.wait()
        after = _samples(await _scrape(port))
    assert reloaded.lines == [f"{path}: configuration reloaded: removed {OTHER}"]
    assert before[f'gopherplug_devices{{health="Healthy",resource="{OTHER}"}}'] == 2
    assert before[f'gopherplug_allocate_seconds_count{{resource="{OTHER}"}}'] == 1
    assert before[f'gopherplug_pre_start_container_seconds_count{{resource="{OTHER}"}}'] == 1
    assert _about(after, OTHER) == {}
    assert _about(after, RESOURCE) == _about(before, RESOURCE)
    assert after[f'gopherplug_allocate_seconds_count{{resource="{RESOURCE}"}}'] == 1


@pytest.mark.slow
async def test_metrics_of_a_dra_pool_are_there_at_0_and_go_with_its_resource_or_its_api(dra_node):
    """The DRA driver's per-resource series follow the same rules: a resource with no device has
    its devices at 0 and its pool's API errors at 0; a removed one loses them all, its pool's too.
    The device-plugin API's series are not made for a DRA resource, and a resource moved to the
    device-plugin API gets those and loses its pool's."""
    port = _free_loopback_port()
    other_devices = dra_node.root / "other-devs"  # empty
    other_devices.mkdir()
    (dra_node.devices / "gopher0").touch()
    cdi_dir = str(dra_node.root / "cdi")
    other = {
        "name": OTHER,
        "directory": str(other_devices),
        "api": "dra",
        "cdi": {"kind": f"{DRIVER}/other", "spec_dir": cdi_dir},
    }
    other_pool = f"node-1/{OTHER}"

    def config(*resources, gopher=True):
        top = {"device_plugin_dir": str(dra_node.root / "dp"), "metrics_address": f"127.0.0.1:{port}"}
        data = yaml.safe_load(dra_config(dra_node.devices, dra_node.kubelet_dir, top, cdi=dra_node.cdi))
        data["resources"] = [*(data["resources"] if gopher else []), *resources]
        return gp.parse_config(yaml.safe_dump(data), "cfg.yaml")

    send, receive = trio.open_memory_channel(1)

    async def updates():
        async for new in receive:
            yield new

    with trio.fail_after(TIMEOUT):
        await dra_node.start(config(other), updates=lambda _: updates())
        await dra_node.wait_for_slices(["gopher0"])
        await dra_node.wait_for_slices([], pool=other_pool)  # an empty pool: one empty slice
        dra_node.api.fail("update", gp.dra_slice_name("node-1", DRIVER, RESOURCE, 0), 500)
        (dra_node.devices / "gopher1").touch()
        await dra_node.wait_for_slices(["gopher0", "gopher1"])  # refused once, then written
        before = _samples(await _scrape(port))
        with logged("configuration reloaded: ") as reloaded:
            await send.send(config(other, gopher=False))
            await reloaded.wait()
        after = _samples(await _scrape(port))
        simulator = await dra_node.nursery.start(gp.KubeletSimulator(str(dra_node.root / "dp")).run)
        with logged("configuration reloaded: ") as moved, logged("registered with the kubelet as") as registered:
            await send.send(config({**other, "api": "device-plugin"}))  # example.com/gopher back, anew
            await moved.wait()
            await registered.wait()  # and counted
        await simulator.wait_until(lambda s: streaming(s, OTHER) == {})
        device_plugin = _samples(await _scrape(port))
    assert reloaded.lines == [f"cfg.yaml: configuration reloaded: removed {RESOURCE}"]
    assert _about(before, OTHER) == {
        f'gopherplug_devices{{health="Healthy",resource="{OTHER}"}}': 0,
        f'gopherplug_devices{{health="Unhealthy",resource="{OTHER}"}}': 0,
    }
    assert before[f'gopherplug_api_errors_total{{pool="{other_pool}"}}'] == 0
    assert before[f'gopherplug_api_errors_total{{pool="{DraNode.POOL}"}}'] == 1
    assert before[f'gopherplug_devices{{health="Healthy",resource="{RESOURCE}"}}'] == 2
    assert _about(after, RESOURCE) == {} and _about(after, DraNode.POOL) == {}
    assert _about(after, OTHER) == _about(before, OTHER)
    assert after[f'gopherplug_api_errors_total{{pool="{other_pool}"}}'] == 0
    assert moved.lines == [f"cfg.yaml: configuration reloaded: added {RESOURCE}, re-registered {OTHER}"]
    assert _about(device_plugin, other_pool) == {}
    assert device_plugin[f'gopherplug_api_errors_total{{pool="{DraNode.POOL}"}}'] == 0  # counted anew
    assert device_plugin[f'gopherplug_devices{{health="Healthy",resource="{OTHER}"}}'] == 0
    assert device_plugin[f'gopherplug_registrations_total{{resource="{OTHER}"}}'] == 1


async def test_metrics_of_a_resource_moved_to_dra_lose_the_device_plugin_apis_series(nursery):
    metrics = gp.Metrics("127.0.0.1:0")
    nursery.start_soon(metrics.serve_http)
    try:
        served = gp.resource_config(RESOURCE)
        metrics.serve(served, None)
        metrics.registrations.labels(RESOURCE).inc()
        metrics.forget(RESOURCE, DraNode.POOL, dataclasses.replace(served, api="dra"))
        with trio.fail_after(TIMEOUT):
            samples = _samples(await _scrape(metrics.port))
    finally:
        metrics.close()
    assert _about(samples, RESOURCE) == {
        f'gopherplug_devices{{health="Healthy",resource="{RESOURCE}"}}': 0,
        f'gopherplug_devices{{health="Unhealthy",resource="{RESOURCE}"}}': 0,
    }
