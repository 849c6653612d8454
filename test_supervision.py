"""Every long-running task of serve supervised: what one raises ends that task only, started again
from the truth with backoff, said once when it fails and once when it runs again, counted, and past a
bound turned into an unhealthy /healthz rather than the process's end. And a reload planned purely,
resource by resource (reload_plan), applied whole or not at all for each.

Faults are injected into the function a task calls, on a plugin that really serves (real sockets,
real inotify, the kubelet's stand-in); each test waits on log lines and the stand-in's events."""

from __future__ import annotations

import functools
import itertools
import logging
import shutil
import socket
import tempfile
from pathlib import Path

import pytest
import trio
import trio.testing
import yaml

import gopherplug as gp
from testsupport import (
    DRIVER,
    RESOURCE,
    TIMEOUT,
    DraNode,
    Node,
    _free_loopback_port,
    _healthz,
    _scrape,
    claim,
    config_text,
    dra_config,
    listed,
    logged,
    reloading,
    replace_file,
    start,
)

AGAIN = "runs again, after"


def injected():
    """The fault, a fresh one at each raise: one shared exception would carry every test's traceback
    (its __traceback__ grows at each raise), and a test could see another's."""
    return RuntimeError("injected")


@pytest.fixture
def short_dir():
    """A short temp dir: unix socket paths have at most 107 bytes."""
    path = tempfile.mkdtemp(prefix="gp-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def node(short_dir):
    return Node(short_dir)


@pytest.fixture
async def dra(nursery, short_dir, monkeypatch):
    """testsupport's DraNode: a DRA kubelet and API server of Kubernetes 1.36."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", "/nonexistent")
    node = DraNode(short_dir, nursery)
    await node.start_servers()
    return node


@pytest.fixture(autouse=True)
def quick(monkeypatch):
    """Backoff in milliseconds: a test waits for lines, never for the production backoff."""
    monkeypatch.setattr(gp, "SUPERVISE_BACKOFF", (0.001, 0.002))


@pytest.fixture
def restarts(monkeypatch):
    """Metrics on for the test: a function giving gopherplug_task_restarts for a task."""
    metrics = gp.Metrics("127.0.0.1:0")
    monkeypatch.setattr(gp, "_metrics", metrics)
    yield lambda task: metrics.registry.get_sample_value("gopherplug_task_restarts_total", {"task": task})
    metrics.close()


def failing(real, times, error=injected, when=lambda *args: True):
    """A stand-in for ``real`` that raises ``error()`` (a class or a factory: a fresh exception each
    time) the first ``times`` calls for which ``when(*args)``."""
    left = [times]

    def stand_in(*args, **kwargs):
        if left[0] and when(*args):
            left[0] -= 1
            raise error()
        return real(*args, **kwargs)

    stand_in.left = left
    return stand_in


async def test_a_failed_directory_watch_is_started_again_and_rescans(nursery, node, monkeypatch, restarts):
    task = f"{RESOURCE}: directory watch"
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node)
        monkeypatch.setattr(gp._SourceTracker, "update", failing(gp._SourceTracker.update, 1))
        with logged(f"{task} failed") as failed, logged(f"{task} {AGAIN}") as again, logged(task) as said:
            Path(node.devices, "g3").touch()  # the batch's update fails; the watch starts again and rescans
            await failed.wait()
            await again.wait()
            await simulator.wait_until(listed("g1", "g2", "g3"))  # the rescan found it
            assert (await simulator.allocate(RESOURCE, ["g3"])).container_responses  # served on meanwhile
    assert failed.lines == [
        f"{task} failed: RuntimeError: injected; starting it again (the traceback is at log level debug)"
    ]
    assert again.lines == [f"{task} {AGAIN} 1 failure"]
    assert [line for line in said.lines if "the failure's traceback" not in line] == failed.lines + again.lines
    assert len(simulator.registrations) == 1, "the registration was not touched"
    assert restarts(task) == 1


async def test_a_failed_registration_is_started_again_and_registers_with_the_kubelet(
    nursery, node, monkeypatch, restarts
):
    task = f"{RESOURCE}: registration"
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node)
        monkeypatch.setattr(gp, "register", failing(gp.register, 2))
        with logged(f"{task} failed") as failed, logged(f"{task} {AGAIN}") as again:
            simulator.restart()  # the next Register fails twice, inside the plugin
            await failed.wait()
            await again.wait()
            await simulator.wait_until(
                lambda s: s.starts == 2 and s.registered_in[-1:] == [2] and listed("g1", "g2")(s)
            )
    assert failed.lines == [
        f"{task} failed: RuntimeError: injected; starting it again (the traceback is at log level debug)"
    ]
    assert again.lines == [f"{task} {AGAIN} 2 failures"]  # said once the kubelet accepted Register, once
    assert simulator.registered_in == [1, 2], "one registration per kubelet start"
    assert restarts(task) == 2


async def test_a_registration_started_again_runs_again_once_the_kubelet_accepted_register(nursery, node, monkeypatch):
    """Its socket listens (started()) before the kubelet has its Register: "runs again" waits for that."""
    task = f"{RESOURCE}: registration"
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node)
        monkeypatch.setattr(gp, "register", failing(gp.register, 1))
        registered = []  # how many Registers the kubelet had when the line was said

        def count(record):
            if AGAIN in record.getMessage():
                registered.append(len(simulator.registrations))
            return True

        with logged(f"{task} {AGAIN}") as again:
            again.addFilter(count)
            simulator.restart()
            await again.wait()
    assert again.lines == [f"{task} {AGAIN} 1 failure"]
    assert registered == [2], "said once the restarted kubelet had accepted Register, not as the socket listened"


async def test_a_task_failing_past_the_bound_turns_healthz_unhealthy_and_the_plugin_serves_on(
    nursery, node, monkeypatch, restarts
):
    monkeypatch.setattr(gp, "SUPERVISE_BOUND", 3)
    port = _free_loopback_port()
    task = f"{RESOURCE}: directory watch"
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node, top={"health_address": f"127.0.0.1:{port}"})
        assert await _healthz(port) == (200, "ok\n")
        monkeypatch.setattr(gp._SourceTracker, "update", failing(gp._SourceTracker.update, 10**9))
        monkeypatch.setattr(gp._SourceTracker, "rescan", failing(gp._SourceTracker.rescan, 10**9))
        with logged(f"{task}: the failure's traceback") as failures, logged(f"{task} failed") as failed:
            Path(node.devices, "g3").touch()
            await failures.wait(3)
            code, said = await _healthz(port)
            assert code == 503
            assert said.startswith(f"{task}: failed ") and "times in a row" in said
            # The devices as known are offered, the other tasks serve: Allocate, a kubelet restart.
            assert (await simulator.allocate(RESOURCE, ["g1"])).container_responses
            simulator.restart()
            await simulator.wait_until(lambda s: s.registered_in[-1:] == [2] and listed("g1", "g2")(s))
    assert len(failed.lines) == 1, "one line for the run of failures, not one a retry"
    assert restarts(task) >= 3


async def test_a_failed_kubelet_watch_is_started_again_and_sees_the_kubelet_that_restarted(
    nursery, node, monkeypatch, restarts
):
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node)
        monkeypatch.setattr(gp.KubeletWatch, "_take", failing(gp.KubeletWatch._take, 1))
        with logged("kubelet watch failed") as failed, logged(f"kubelet watch {AGAIN}") as again:
            simulator.restart()  # its kubelet.sock events fail the watch: the restart is seen by its rescan
            await failed.wait()
            await again.wait()
            await simulator.wait_until(lambda s: s.registered_in[-1:] == [2] and listed("g1", "g2")(s))
    assert len(failed.lines) == len(again.lines) == 1
    assert simulator.registered_in == [1, 2]
    assert restarts("kubelet watch") == 1


async def test_a_failed_reload_is_started_again_and_applies_that_configuration(
    nursery, node, tmp_path, monkeypatch, restarts
):
    path = tmp_path / "gopherplug.yaml"
    path.write_text(config_text(node, **{RESOURCE: {}}))
    with trio.fail_after(TIMEOUT):
        simulator = await reloading(nursery, node, path)
        monkeypatch.setattr(gp, "reload_plan", failing(gp.reload_plan, 1))
        task = "configuration reloads"
        with logged(f"{task} failed") as failed, logged("configuration reloaded") as reloaded:
            replace_file(path, config_text(node, **{RESOURCE: {"env": "GOPHER_IDS"}}))
            await reloaded.wait()
        answer = await simulator.allocate(RESOURCE, ["g1"])
        with logged("configuration reloaded") as next_one:  # and it goes on with the file's next change
            replace_file(path, config_text(node, **{RESOURCE: {"env": "GOPHER_NEXT"}}))
            await next_one.wait()
        later = await simulator.allocate(RESOURCE, ["g1"])
    assert len(failed.lines) == 1
    assert reloaded.lines == [f"{path}: configuration reloaded: updated in place {RESOURCE}"]
    assert dict(answer.container_responses[0].envs) == {"GOPHER_IDS": "g1"}
    assert dict(later.container_responses[0].envs) == {"GOPHER_NEXT": "g1"}
    assert len(simulator.registrations) == 1
    assert restarts(task) == 1


async def test_a_failed_nfd_writer_is_started_again_and_writes_the_file(nursery, node, tmp_path, monkeypatch, restarts):
    features = tmp_path / "features.d" / "gopherplug"
    task = "NFD feature file"
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node, top={"nfd_features_file": str(features)})
        monkeypatch.setattr(gp, "nfd_features", failing(gp.nfd_features, 1))
        with logged(f"{task} failed") as failed, logged(f"{task} {AGAIN}") as again:
            Path(node.devices, "g3").touch()
            await failed.wait()
            await again.wait()
        await simulator.wait_until(listed("g1", "g2", "g3"))
        while "=3" not in (features.read_text() if features.exists() else ""):
            with logged("") as anything:
                await anything.wait()
    assert len(failed.lines) == len(again.lines) == 1
    assert restarts(task) == 1


async def test_a_reload_to_dra_without_the_driver_keeps_the_device_plugin_serving(nursery, node, tmp_path):
    path = tmp_path / "gopherplug.yaml"
    path.write_text(config_text(node, **{RESOURCE: {}}))
    with trio.fail_after(TIMEOUT):
        simulator = await reloading(nursery, node, path)
        with logged(RESOURCE) as said, logged("configuration reloaded") as reloaded:
            moved = yaml.safe_load(config_text(node, **{RESOURCE: {"api": "dra"}}))
            replace_file(path, yaml.safe_dump({**moved, "dra": {"driver": "gopher.example.com"}}))
            await reloaded.wait()
        await trio.testing.wait_all_tasks_blocked()
        assert listed("g1", "g2")(simulator)
        assert (await simulator.allocate(RESOURCE, ["g1"])).container_responses
    assert [event for event in simulator.events if event[0] != "registered"] == []
    assert [line for line in said.lines if "next start" in line] == [
        f"{RESOURCE}: api: dra takes effect at the next start (the DRA driver is not running): kept as it was"
    ]
    assert reloaded.lines == [f"{path}: configuration reloaded: kept {RESOURCE} as it was"]


def _config(**resources):
    entries = [
        {"name": name, "directory": "/srv", "pattern": "gopher*", **fields} for name, fields in resources.items()
    ]
    dra = {"dra": {"driver": "gopher.example.com"}} if any(entry.get("api") == "dra" for entry in entries) else {}
    return gp.parse_config(yaml.safe_dump({**dra, "resources": entries}), "test.yaml")


def _running(**resources):
    return {resource.name: resource for resource in _config(**resources).resources}


def test_reload_plan_says_what_each_resource_gets():
    running = _running(**{"a/kept": {}, "a/env": {}, "a/pre": {}, "a/gone": {}, "a/desc": {"describe": ["/bin/true"]}})
    new = _config(
        **{
            "a/kept": {},
            "a/env": {"env": "OTHER"},
            "a/pre": {"pre_start": ["/bin/true"]},
            "a/desc": {"describe": ["/bin/true"]},
            "a/new": {},
        }
    )
    assert gp.reload_plan(running, new, dra=False) == {
        "a/gone": ("stop", ""),
        "a/kept": ("keep", ""),
        "a/env": ("update", ""),
        "a/pre": ("register", ""),
        "a/desc": ("again", ""),
        "a/new": ("start", ""),
    }


@pytest.mark.parametrize("dra", [False, True])
def test_reload_plan_refuses_a_move_to_dra_without_the_driver(dra):
    running = _running(**{"a/moved": {}})
    new = _config(**{"a/moved": {"api": "dra"}})
    why = "api: dra takes effect at the next start (the DRA driver is not running)"
    assert gp.reload_plan(running, new, dra=dra) == {"a/moved": ("register", "") if dra else ("refuse", why)}
    # Back from DRA to the device plugin needs no driver: served and registered anew.
    assert gp.reload_plan({"a/moved": new.resources[0]}, _config(**{"a/moved": {}}), dra=dra) == {
        "a/moved": ("register", "")
    }


def test_reload_plan_is_pure():
    running = _running(**{"a/x": {}})
    new = _config(**{"a/x": {"env": "OTHER"}})
    before = dict(running)
    assert gp.reload_plan(running, new, dra=False) == gp.reload_plan(running, new, dra=False)
    assert running == before


async def test_a_failed_list_and_watch_stream_ends_that_stream_only_and_the_resource_registers_again(
    nursery, node, monkeypatch
):
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node)
        encode = failing(gp._ListEncoder.encode, 1, when=lambda encoder, devices, *_: "g3" in devices)
        monkeypatch.setattr(gp._ListEncoder, "encode", encode)
        with logged("a ListAndWatch stream failed") as again, logged("ListAndWatch") as said:
            Path(node.devices, "g3").touch()
            await again.wait()
            await simulator.wait_until(lambda s: len(s.registrations) == 2 and listed("g1", "g2", "g3")(s))
        assert (await simulator.allocate(RESOURCE, ["g3"])).container_responses
    assert again.lines == [f"{RESOURCE}: a ListAndWatch stream failed: serving and registering again"]
    assert [line for line in said.lines if "injected" in line and not line.startswith("simulated kubelet")] == [
        f"v1beta1.DevicePlugin/ListAndWatch: RuntimeError: injected: {gp_bug()}"
    ]
    assert simulator.registered_in == [1, 1], "the same kubelet, registered anew"
    assert [event[0] for event in simulator.events].count("stream ended") >= 1


def gp_bug():
    return "held back; a bug in gopherplug, please report it (its traceback is logged at log level debug)"


async def test_a_failed_health_server_is_started_again_on_its_port(nursery, node, monkeypatch, restarts):
    port = _free_loopback_port()
    with trio.fail_after(TIMEOUT):
        await start(nursery, node, top={"health_address": f"127.0.0.1:{port}"})
        # Its accept() fails (one of the health server's own), and the task with it: the port is closed,
        # and bound again when it starts again.
        when = lambda listener: listener.getsockname()[1] == port  # noqa: E731
        monkeypatch.setattr(socket.socket, "accept", failing(socket.socket.accept, 1, when=when))
        with logged("health server failed") as failed, logged(f"health server {AGAIN}") as again:
            with pytest.raises(Exception):  # noqa: B017 - the connection is closed or reset unanswered
                await _healthz(port)
            await failed.wait()
            await again.wait()
        assert await _healthz(port) == (200, "ok\n")
    assert len(failed.lines) == len(again.lines) == 1
    assert restarts("health server") == 1


async def test_a_failed_slice_publisher_is_started_again_and_publishes(dra, monkeypatch, restarts):
    for name in ("gopher0", "gopher1"):
        (dra.devices / name).touch()
    with trio.fail_after(TIMEOUT):
        await dra.start()
        await dra.registered()
        await dra.wait_for_slices(["gopher0", "gopher1"])
        when = lambda driver, node, resource, devices, *_: "gopher2" in devices  # noqa: E731
        monkeypatch.setattr(gp, "resource_slices", failing(gp.resource_slices, 2, when=when))
        with logged("slice publisher failed") as failed, logged(f"slice publisher {AGAIN}") as again:
            (dra.devices / "gopher2").touch()
            await failed.wait()
            await dra.wait_for_slices(["gopher0", "gopher1", "gopher2"])
            await again.wait()
        assert DRIVER in dra.kubelet.drivers  # the kubelet's side served on
    assert len(failed.lines) == len(again.lines) == 1
    assert restarts("slice publisher") == 2


@pytest.mark.parametrize(
    ("task", "socket_path"),
    [
        ("DRAPlugin server", f"plugins/{DRIVER}/dra.sock"),
        ("registration server", f"plugins_registry/{DRIVER}-reg.sock"),
    ],
)
async def test_a_failed_dra_socket_server_is_started_again_on_its_socket(dra, monkeypatch, restarts, task, socket_path):
    (dra.devices / "gopher0").touch()
    with trio.fail_after(TIMEOUT):
        await dra.start()
        await dra.registered()
        endpoint = dra.kubelet_dir / socket_path
        monkeypatch.setattr(gp, "serve_grpc", failing(gp.serve_grpc, 1, when=lambda path, *_: path == str(endpoint)))
        with logged(f"{task} failed") as failed, logged(f"{task} {AGAIN}") as again:
            endpoint.unlink()  # served again: the first try fails inside the plugin
            await failed.wait()
            await again.wait()
        await dra.wait_for_slices(["gopher0"])  # the API server's side served on
        assert endpoint.is_socket()
        if task == "registration server":  # the kubelet's plugin watcher finds the driver again
            await dra.registered()
    assert len(failed.lines) == len(again.lines) == 1
    assert restarts(task) == 1


async def test_a_failed_metrics_server_is_started_again_on_its_port(nursery, node, monkeypatch):
    with trio.fail_after(TIMEOUT):
        await start(nursery, node, top={"metrics_address": "127.0.0.1:0"})
        metrics = gp._metrics
        when = lambda listener: listener.getsockname()[1] == metrics.port  # noqa: E731
        monkeypatch.setattr(socket.socket, "accept", failing(socket.socket.accept, 1, when=when))
        with logged("metrics server failed") as failed, logged(f"metrics server {AGAIN}") as again:
            with pytest.raises(OSError):  # the connection reset unanswered: the port is closed, then bound again
                await _scrape(metrics.port)
            await failed.wait()
            await again.wait()
        assert "gopherplug_task_restarts_total" in await _scrape(metrics.port)
    assert len(failed.lines) == len(again.lines) == 1
    assert metrics.registry.get_sample_value("gopherplug_task_restarts_total", {"task": "metrics server"}) == 1


async def publishing_two(dra, monkeypatch):
    """The DRA driver publishing two devices, the handling of its next slice event set to fail once."""
    for name in ("gopher0", "gopher1"):
        (dra.devices / name).touch()
    await dra.start()
    await dra.registered()
    await dra.wait_for_slices(["gopher0", "gopher1"])
    monkeypatch.setattr(gp, "_older", failing(gp._older, 1))  # the next slice event's handling


async def test_a_failed_slice_watch_is_started_again_and_relists(dra, monkeypatch, restarts):
    with trio.fail_after(TIMEOUT):
        await publishing_two(dra, monkeypatch)
        with logged("slice watch failed") as failed, logged(f"slice watch {AGAIN}") as again:
            (dra.devices / "gopher2").touch()  # the publisher's write comes back as an event
            await failed.wait()
            await again.wait()
        await dra.wait_for_slices(["gopher0", "gopher1", "gopher2"])
        (dra.devices / "gopher0").unlink()  # the relisted watch and the publisher go on together
        await dra.wait_for_slices(["gopher1", "gopher2"])
    assert len(failed.lines) == len(again.lines) == 1
    assert restarts("slice watch") == 1


async def test_a_slice_watch_started_again_during_an_api_outage_says_one_line_each_way(dra, monkeypatch):
    """The supervisor's line began the outage: the watch's own lines for the same outage (the API
    server's 502s met by the run started again) are debug, and "runs again" waits for its list."""
    monkeypatch.setattr(gp, "DRA_WATCH_BACKOFF", (0.001, 0.002))
    with trio.fail_after(TIMEOUT):
        await publishing_two(dra, monkeypatch)
        dra.api.garble("html-502", times=2, verb="list", resource="resourceslices")  # the relists meet an outage
        with logged("") as said, logged(f"slice watch {AGAIN}") as again:
            said.setLevel(logging.INFO)
            (dra.devices / "gopher2").touch()
            await again.wait()
            while dra.api.garbled["html-502"] < 2:
                await dra.api.changed.wait_touched()
        await dra.wait_for_slices(["gopher0", "gopher1", "gopher2"])
    assert [line for line in said.lines if "slice watch" in line or "watching ResourceSlices" in line] == [
        "slice watch failed: RuntimeError: injected; starting it again (the traceback is at log level debug)",
        f"slice watch {AGAIN} 1 failure",
    ]


async def test_a_failed_claim_status_writer_is_started_again_and_writes_the_next(dra, monkeypatch, restarts):
    (dra.devices / "gopher0").touch()
    real = gp.ClaimPreparer._write_status
    left = [1]

    async def write_status(self, claim, devices):
        if left[0]:
            left[0] -= 1
            raise injected()
        await real(self, claim, devices)

    monkeypatch.setattr(gp.ClaimPreparer, "_write_status", write_status)
    with trio.fail_after(TIMEOUT):
        await dra.start()
        await dra.registered()
        await dra.wait_for_slices(["gopher0"])
        device = ("gopher", DRIVER, DraNode.POOL, "gopher0")
        for name, uid in (("c1", "uid-1"), ("c2", "uid-2")):
            dra.api.put_claim(claim(name, uid, device))
        with logged("claim status writer failed") as failed, logged(f"claim status writer {AGAIN}") as again:
            first = await dra.kubelet.prepare(DRIVER, [("default", "uid-1", "c1")])  # its status write fails
            await failed.wait()
            await again.wait()
            second = await dra.kubelet.prepare(DRIVER, [("default", "uid-2", "c2")])
            while not dra.api.status_writes:
                await dra.api.changed.wait_touched()
    assert not first.claims["uid-1"].error and not second.claims["uid-2"].error, "the answers stand"
    assert dra.api.claims["default", "c2"]["status"]["devices"][0]["device"] == "gopher0"
    assert len(failed.lines) == len(again.lines) == 1
    assert restarts("claim status writer") == 1


async def test_a_failed_peer_watch_is_started_again_and_looks_again(dra, monkeypatch, restarts):
    (dra.devices / "gopher0").touch()
    real = gp.DriverPeers._check
    left = [1]

    async def check(self):
        if left[0]:
            left[0] -= 1
            raise injected()
        return await real(self)

    with trio.fail_after(TIMEOUT):
        await dra.start()
        await dra.registered()
        await dra.wait_for_slices(["gopher0"])
        monkeypatch.setattr(gp.DriverPeers, "_check", check)
        with logged("peer watch failed") as failed, logged(f"peer watch {AGAIN}") as again:
            (dra.kubelet_dir / "plugins_registry" / "another.example.com-reg.sock").touch()  # a change there
            await failed.wait()
            await again.wait()
        (dra.devices / "gopher1").touch()  # the publisher, which asks the peers, serves on
        await dra.wait_for_slices(["gopher0", "gopher1"])
    assert left == [0]
    assert len(failed.lines) == len(again.lines) == 1
    assert restarts("peer watch") == 1


async def test_what_the_node_refuses_for_now_is_retried_without_failing_the_health_check(autojump_clock, monkeypatch):
    """NotYet (a reload's CDI spec on a full disk) is retried with the same backoff, but /healthz does
    not count it: a new pod would meet the same disk, and the old one serves meanwhile. Any other
    failure in the same run counts as before."""
    monkeypatch.setattr(gp, "SUPERVISE_BOUND", 2)
    health = gp.Health()
    token = gp._HEALTH.set(health)
    raised = [functools.partial(gp.NotYet, "for now")] * 4 + [injected] * 2
    seen = []  # what /healthz says as each run starts, after the failures before it
    began = [trio.Event()]

    async def task(*, task_status):
        seen.append(health.problems())
        began[0].set()
        began[0] = trio.Event()
        if len(seen) <= len(raised):
            raise raised[len(seen) - 1]()
        task_status.started()
        await trio.sleep_forever()

    with logged("flaky"):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(gp._supervised, "flaky", task)
            while len(seen) <= len(raised):  # the backoff's waits pass on the virtual clock at once
                await began[0].wait()
            nursery.cancel_scope.cancel()
    gp._HEALTH.reset(token)
    # Four NotYet and one real failure: under the bound of 2; the second real failure reaches it.
    assert seen == [[]] * 6 + [["flaky: failed 6 times in a row"]]


async def test_supervised_backs_off_says_one_line_each_way_and_a_new_run_of_failures_after_steady(
    autojump_clock, monkeypatch
):
    """_supervised on its own, on trio's virtual clock: the waits double from the base to the cap,
    jittered; one line when failures begin and one when the task runs again; the bound fails the
    health check until the task has run SUPERVISE_STEADY seconds; a failure after that is a new run."""
    monkeypatch.setattr(gp, "SUPERVISE_BACKOFF", (1.0, 4.0))
    monkeypatch.setattr(gp, "SUPERVISE_BOUND", 3)
    health = gp.Health()
    token = gp._HEALTH.set(health)  # as serve_plugin sets it: the task started below has it
    starts = []
    fail, began = trio.Event(), [trio.Event()]

    async def task(*, task_status):
        starts.append(trio.current_time())
        began[0].set()
        began[0] = trio.Event()
        if len(starts) <= 4:
            raise injected()  # before started(): a failure of a restart counts as well
        task_status.started()
        await fail.wait()
        raise injected()

    with logged("flaky") as said:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(gp._supervised, "flaky", task)
            while len(starts) < 5:  # the backoff's waits pass on the virtual clock at once
                await began[0].wait()
            await trio.testing.wait_all_tasks_blocked()
            assert health.problems() == ["flaky: failed 4 times in a row"]  # past the bound, not steady yet
            autojump_clock.jump(gp.SUPERVISE_STEADY + 0.001)  # (t + 60) - t may be 59.999...: floats
            assert health.problems() == []  # it has run long enough since it came back
            fail.set()
            while len(starts) < 6:
                await began[0].wait()
            nursery.cancel_scope.cancel()
    gp._HEALTH.reset(token)
    waits = [later - earlier for earlier, later in itertools.pairwise(starts[:5])]
    for wait, base in zip(waits, (1.0, 2.0, 4.0, 4.0), strict=True):
        assert base <= wait <= base * (1 + gp.DRA_JITTER) + 0.5
    lines = [line for line in said.lines if "traceback" not in line or "failed:" in line]
    failure = "flaky failed: RuntimeError: injected; starting it again (the traceback is at log level debug)"
    # The second run of failures: one line, and one when it runs again (its failures after that,
    # each soon after its start, are the same run: no line).
    assert lines == [failure, "flaky runs again, after 4 failures", failure, "flaky runs again, after 1 failure"]


async def test_a_reload_whose_watch_failed_watches_the_file_anew_and_applies_what_changed_meanwhile(
    nursery, node, tmp_path, monkeypatch, restarts
):
    path = tmp_path / "gopherplug.yaml"
    path.write_text(config_text(node, **{RESOURCE: {}}))
    with trio.fail_after(TIMEOUT):
        simulator = await reloading(nursery, node, path)
        monkeypatch.setattr(gp, "_file_text", failing(gp._file_text, 1))  # the watch's read raises: it is finished
        task = "configuration reloads"
        with logged(f"{task} failed") as failed, logged("configuration reloaded") as reloaded:
            replace_file(path, config_text(node, **{RESOURCE: {"env": "GOPHER_IDS"}}))
            await reloaded.wait()  # the new watch read the file at once
        answer = await simulator.allocate(RESOURCE, ["g1"])
        with logged("configuration reloaded") as next_one:  # and it follows the file's next change
            replace_file(path, config_text(node, **{RESOURCE: {"env": "GOPHER_NEXT"}}))
            await next_one.wait()
        later = await simulator.allocate(RESOURCE, ["g1"])
    assert failed.lines == [
        f"{task} failed: RuntimeError: injected; starting it again (the traceback is at log level debug)"
    ]
    assert reloaded.lines == [f"{path}: configuration reloaded: updated in place {RESOURCE}"]
    assert dict(answer.container_responses[0].envs) == {"GOPHER_IDS": "g1"}
    assert dict(later.container_responses[0].envs) == {"GOPHER_NEXT": "g1"}
    assert restarts(task) == 1


async def test_a_reload_the_environment_refused_is_applied_again_once_it_can_be(
    nursery, node, tmp_path, monkeypatch, restarts
):
    path, spec_dir = tmp_path / "gopherplug.yaml", tmp_path / "cdi"
    cdi = {"cdi": {"kind": "example.com/gopher", "spec_dir": str(spec_dir)}}
    path.write_text(config_text(node, **{RESOURCE: cdi}))
    with trio.fail_after(TIMEOUT):
        await reloading(nursery, node, path)
        # The CDI directory is full for one write, then not.
        full = functools.partial(OSError, 28, "No space left on device")
        monkeypatch.setattr(gp, "_replace_whole", failing(gp._replace_whole, 1, error=full))
        task = "configuration reloads"
        with logged(f"{task} failed") as failed, logged("configuration reloaded") as reloaded:
            mounts = {"mounts": [{"host_path": "{path}", "container_path": "/m"}]}
            replace_file(path, config_text(node, **{RESOURCE: {**cdi, **mounts}}))
            await reloaded.wait(2)  # refused by the full disk, then applied by the task started again
    spec = next(spec_dir.glob("*.json")).read_text()
    assert '"/m"' in spec, "the new configuration's spec is written"
    assert failed.lines == [], "the reload said why itself"
    assert reloaded.lines == [
        f"{path}: configuration reloaded: kept {RESOURCE} as it was",
        f"{path}: configuration reloaded: updated in place {RESOURCE}",
    ]
    assert restarts(task) == 1


async def test_a_refusal_tried_again_says_its_lines_once_and_one_when_it_applies(
    nursery, node, tmp_path, monkeypatch, restarts
):
    """A full, then read-only, CDI directory refuses a reload for several tries: its lines (the resource's
    error, the summary) are said at the first and when the reason changes, the tries in between at
    debug, and one line when it applies."""
    path, spec_dir = tmp_path / "gopherplug.yaml", tmp_path / "cdi"
    cdi = {"cdi": {"kind": "example.com/gopher", "spec_dir": str(spec_dir)}}
    path.write_text(config_text(node, **{RESOURCE: cdi}))
    with trio.fail_after(TIMEOUT):
        await reloading(nursery, node, path)
        full, read_only = OSError(28, "No space left on device"), OSError(30, "Read-only file system")
        refusals, real = iter([full, full, read_only, read_only]), gp._replace_whole  # four tries, two reasons

        def replace_whole(*args, **kwargs):
            if (refusal := next(refusals, None)) is not None:
                raise refusal
            return real(*args, **kwargs)

        monkeypatch.setattr(gp, "_replace_whole", replace_whole)
        with logged("") as said, logged("configuration reloaded: updated") as applied:
            said.setLevel(logging.INFO)
            mounts = {"mounts": [{"host_path": "{path}", "container_path": "/m"}]}
            replace_file(path, config_text(node, **{RESOURCE: {**cdi, **mounts}}))
            await applied.wait()
    spec = spec_dir / "example.com-gopher.json"
    assert '"/m"' in spec.read_text(), "the new configuration's spec is written"
    kept = f"{path}: configuration reloaded: kept {RESOURCE} as it was"
    assert [line for line in said.lines if "CDI spec" in line or "reload" in line] == [
        f"{RESOURCE}: cannot write the CDI spec {spec}: No space left on device: not applied, tried again",
        kept,
        f"{RESOURCE}: cannot write the CDI spec {spec}: Read-only file system: not applied, tried again",
        kept,  # said again with its new reason, then once applied:
        f"{path}: configuration reloaded: updated in place {RESOURCE}",
    ]
    assert restarts("configuration reloads") == 4


async def test_a_reload_the_configuration_refused_is_not_tried_again(nursery, node, tmp_path, restarts):
    path = tmp_path / "gopherplug.yaml"
    path.write_text(config_text(node, **{RESOURCE: {}}))
    with trio.fail_after(TIMEOUT):
        await reloading(nursery, node, path)
        with logged("configuration reloaded") as reloaded:
            moved = yaml.safe_load(config_text(node, **{RESOURCE: {"api": "dra"}}))
            replace_file(path, yaml.safe_dump({**moved, "dra": {"driver": "gopher.example.com"}}))
            await reloaded.wait()
            await trio.testing.wait_all_tasks_blocked()
    assert reloaded.lines == [f"{path}: configuration reloaded: kept {RESOURCE} as it was"]
    assert restarts("configuration reloads") is None


async def test_a_slice_publisher_started_again_follows_the_devices(dra, monkeypatch, restarts):
    for name in ("gopher0", "gopher1"):
        (dra.devices / name).touch()
    real, left = gp.SlicePublisher._sync_pool, [1]

    async def sync_pool(self, pool, *args):
        await real(self, pool, *args)
        if left[0]:  # written, then kept as an answer of the wrong shape (no spec) would be, and failed on
            left[0] -= 1
            for item in self.known.values():
                del item["spec"]
            raise KeyError("spec")

    with trio.fail_after(TIMEOUT):
        await dra.start()
        await dra.registered()
        await dra.wait_for_slices(["gopher0", "gopher1"])
        monkeypatch.setattr(gp.SlicePublisher, "_sync_pool", sync_pool)
        with logged("slice publisher failed") as failed, logged(f"slice publisher {AGAIN}") as again:
            (dra.devices / "gopher2").touch()
            await failed.wait()
            await again.wait()
        await dra.wait_for_slices(["gopher0", "gopher1", "gopher2"])
        for name in ("gopher3", "gopher4"):  # later changes, one at a time: each is published
            (dra.devices / name).touch()
            await dra.wait_for_slices(sorted({"gopher0", "gopher1", "gopher2", "gopher3", name}))
        (dra.devices / "gopher0").unlink()
        await dra.wait_for_slices(["gopher1", "gopher2", "gopher3", "gopher4"])
    assert len(failed.lines) == len(again.lines) == 1
    assert restarts("slice publisher") == 1


async def test_a_pool_whose_writes_keep_failing_says_one_line_and_one_when_they_work(dra_node):
    """The API server refuses a pool's slice writes several times running: one warning when the
    writes begin to fail, the retries in between at debug, one line when a write is taken."""
    (dra_node.devices / "gopher0").touch()
    with trio.fail_after(TIMEOUT):
        await dra_node.start(gp.parse_config(dra_config(dra_node.devices, dra_node.kubelet_dir), "cfg.yaml"))
        await dra_node.wait_for_slices(["gopher0"])
        refused = gp.dra_slice_name("node-1", DRIVER, RESOURCE, 0)
        dra_node.api.fail("update", refused, 500, times=4)
        with logged("DRA: writing ResourceSlices") as said, logged("") as debug:
            said.setLevel(logging.INFO)
            (dra_node.devices / "gopher1").touch()
            await dra_node.wait_for_slices(["gopher0", "gopher1"])
            await said.wait(2)  # the answer taken: the second line
    tries = [answer for _, verb, name, answer in dra_node.api.attempts if name == refused and verb == "update"]
    assert tries == [500, 500, 500, 500, 200]
    assert [line.split(": 500")[0] for line in said.lines] == [
        f"DRA: writing ResourceSlices: update ResourceSlice {refused}",
        f"DRA: writing ResourceSlices (node-1/{RESOURCE}) works again",
    ]
    assert sum("DRA: writing ResourceSlices" in line for line in debug.lines) == 5, "the retries, at debug"


async def test_a_failure_that_meets_its_tasks_stop_ends_with_the_task_and_not_the_plugin():
    """A task is stopped (a reload retiring its resource, SIGTERM) just as one of its own tasks fails:
    the failure and the stop's Cancelled come out of its nursery together, in one group. The task ends
    as stopped; the failure must not go on and end the plugin."""

    async def task(*, task_status):
        async def fails_as_it_stops():
            try:
                await trio.sleep_forever()
            finally:
                raise injected()  # what a scan in flight raises when its watch stops

        async with trio.open_nursery() as inner:
            inner.start_soon(fails_as_it_stops)
            task_status.started()
            await trio.sleep_forever()

    with trio.fail_after(TIMEOUT), trio.CancelScope() as stop:
        async with trio.open_nursery() as nursery:
            await nursery.start(gp._supervised, "a task", task)
            stop.cancel()
    assert stop.cancelled_caught
