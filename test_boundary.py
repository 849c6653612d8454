"""The boundary: a bug met by an input is that input's refusal, never the process's end."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import trio
import trio.socket
import trio.testing
from google.protobuf.json_format import MessageToDict
from inotify_simple import INotify
from inotify_simple import flags as inotify_flags

import gopherplug as gp
import gopherplug_standins as standins
from gopherplug import StatusCode
from testsupport import (
    BUG,
    DRIVER,
    MINIMAL,
    POD_UID,
    PRIORITIZED_REQUESTS,
    RESOURCE,
    SHARE_1,
    TIMEOUT,
    DraNode,
    cdi_problem,
    claim,
    config_text,
    described_calls,
    dra_config,
    listed,
    logged,
    program_file,
    read_spec,
    reloading,
    replace_file,
    start,
)

SHARE_2 = "5b0e1c2a-8f4d-4c3e-9a1b-0d2e3f4a5b62"


SHARE_3 = "5b0e1c2a-8f4d-4c3e-9a1b-0d2e3f4a5b63"


# ------------------------------------------------------------------------------------------------
# The boundary: a bug met by an input is that input's refusal, never the process's end
# ------------------------------------------------------------------------------------------------


def raising(error, when=lambda *args: True, real=None):
    """A stand-in that raises ``error`` when ``when(*args)``, else calls ``real``."""

    def stand_in(*args, **kwargs):
        if when(*args):
            raise error
        return real(*args, **kwargs)

    return stand_in


async def test_a_bug_met_by_a_reload_keeps_the_running_configuration(nursery, node, tmp_path, monkeypatch, unexpected):
    path = tmp_path / "gopherplug.yaml"
    path.write_text(config_text(node, **{RESOURCE: {}}))
    real = gp._config_from_text
    monkeypatch.setattr(gp, "_config_from_text", raising(RecursionError("too deep"), lambda t, *_: "bug" in t, real))
    with trio.fail_after(TIMEOUT):
        simulator = await reloading(nursery, node, path)
        with logged("keeping the running configuration") as said:
            replace_file(path, config_text(node, **{RESOURCE: {"env": "GOPHER_IDS"}}) + "# bug\n")
            await said.wait()
        with logged("configuration reloaded") as applied:  # the plugin lives on, and applies the next good file
            replace_file(path, config_text(node, **{RESOURCE: {"env": "GOPHER_IDS"}}))
            await applied.wait()
        await simulator.wait_until(listed("g1", "g2"))
    assert said.lines == [f"{path}: RecursionError: too deep: {BUG}; keeping the running configuration"]
    assert unexpected("config") == 1


async def test_a_bug_met_by_a_devices_values_keeps_the_device_offered(nursery, node, monkeypatch, unexpected):
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node, attributes={"model": "gopher"})
        monkeypatch.setattr(gp, "with_read_values", raising(UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogate")))
        with logged("attributes and capacity") as said:
            Path(node.devices, "g3").touch()
            await said.wait()
        await simulator.wait_until(listed("g1", "g2", "g3"))
    assert said.lines == [
        f"{RESOURCE}: device g3's attributes and capacity: UnicodeEncodeError: 'utf-8' codec can't encode character "
        f"'\\ud800' in position 0: surrogate: {BUG}"
    ]
    assert unexpected("values") == 1


DESCRIBE_GOPHERS = """#!{python}
import json, os
ids = (os.environ.get("GOPHERPLUG_DEVICES") or open(os.environ["GOPHERPLUG_DEVICES_FILE"]).read()).split(",")
print(json.dumps({i: {"attributes": {"model": "gopher"}} for i in ids}))
"""


async def test_a_bug_met_by_describe_keeps_what_it_said(nursery, node, monkeypatch, unexpected):
    script = program_file(node.plugin_dir, DESCRIBE_GOPHERS)
    resource = node.config(describe=[script]).resources[0]
    devices = gp.Watched({})
    with trio.fail_after(TIMEOUT):
        await nursery.start(gp.watch_devices, resource, devices)
        while devices.value.get("g1") is None or not devices.value["g1"].attributes:
            await devices.wait_touched()
        known = devices.value["g1"].attributes
        monkeypatch.setattr(gp, "parse_description", raising(RecursionError("maximum recursion depth exceeded")))
        with logged("describe") as said:
            Path(node.devices, "g3").touch()
            await said.wait()
        assert devices.value["g1"].attributes == known
    assert said.lines == [
        f"{RESOURCE}: describe {script}: RecursionError: maximum recursion depth exceeded: {BUG}; the devices are "
        "offered without what it would say (2 keep what it said before)"
    ]
    assert unexpected("describe") == 1


async def test_a_bug_met_by_an_http_request_is_a_500_and_the_server_goes_on(nursery, monkeypatch, unexpected):
    real = gp._request_path
    monkeypatch.setattr(gp, "_request_path", raising(KeyError("bug"), lambda target: target == b"/bug", real))
    answer = functools.partial(gp.health_answer, gp.Health())
    listener = gp._http_listener("127.0.0.1:0", "health_address")
    port = listener.getsockname()[1]
    with trio.fail_after(TIMEOUT), logged("HTTP request") as said:
        await nursery.start(gp._serve_http, listener, answer)
        for target, code in ((b"/bug", b"500"), (b"/healthz", b"200")):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n\r\n")
            reply = b""
            while chunk := await stream.receive_some(4096):
                reply += chunk
            await stream.aclose()
            assert reply.split(b" ")[1] == code
    assert said.lines == [f"HTTP request b'GET /bug HTTP/1.1': KeyError: 'bug': {BUG}"]
    assert unexpected("http") == 1


async def test_a_bug_met_by_a_grpc_call_is_unknown_and_the_plugin_goes_on(nursery, node, monkeypatch, unexpected):
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node)
        real = gp.allocate_with_devices
        monkeypatch.setattr(gp, "allocate_with_devices", raising(ZeroDivisionError("division by zero")))
        with logged("Allocate") as said, pytest.raises(gp.RPCError) as failed:
            await simulator.allocate(RESOURCE, ["g1"])
        monkeypatch.setattr(gp, "allocate_with_devices", real)
        answer = await simulator.allocate(RESOURCE, ["g1"])
        assert dict(answer.container_responses[0].envs) == {"GOPHER_DEVICES": "g1"}
    line = f"v1beta1.DevicePlugin/Allocate: ZeroDivisionError: division by zero: {BUG}"
    assert (failed.value.code, failed.value.message) == (StatusCode.UNKNOWN, line)
    assert said.lines == [line]
    assert unexpected("grpc") == 1


def test_a_bug_in_check_config_is_one_line_and_no_traceback(node, tmp_path, monkeypatch, capsys):
    path = tmp_path / "gopherplug.yaml"
    path.write_text(config_text(node, **{RESOURCE: {}}))
    monkeypatch.setattr(gp, "scan_directory", raising(RecursionError("maximum recursion depth exceeded")))
    monkeypatch.delenv("GOPHERPLUG_LOG_LEVEL", raising=False)
    assert gp.main(["check-config", "--config", str(path)]) == gp.EXIT_FAILURE
    err = capsys.readouterr().err
    assert err == f"gopherplug: RecursionError: maximum recursion depth exceeded: {BUG}\n"
    monkeypatch.setenv("GOPHERPLUG_LOG_LEVEL", "debug")  # then its traceback follows the line
    assert gp.main(["check-config", "--config", str(path)]) == gp.EXIT_FAILURE
    assert "Traceback (most recent call last)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ('{"0": {"attributes": {"model": "\\ud800"}}}', "a string holds a lone surrogate"),
        ('{"\\udfff": {}}', "a string holds a lone surrogate"),
    ],
)
def test_describe_output_nested_too_deeply_or_with_a_lone_surrogate_is_refused(text, why):
    with pytest.raises(ValueError, match=why):
        gp.parse_description(text)


async def test_describe_answer_is_taken_when_it_exits_and_what_it_left_is_killed(tmp_path):
    """A describe that leaves a child holding its stdout (`sleep &`): the answer is used as soon as
    the program exits, not after its 10 s timeout, and the child is killed with its process group."""
    pid_file = tmp_path / "child"
    script = program_file(tmp_path, f"#!/bin/sh\nsleep 300 &\necho $! > {pid_file}\necho '{{\"g1\": {{}}}}'\n")
    resource = dataclasses.replace(gp.parse_config(MINIMAL, "t.yaml").resources[0], describe=(script,))
    with trio.fail_after(gp.DESCRIBE_TIMEOUT / 2):
        described, unknown = await gp.run_describe(resource, ["g1"])
    assert (described, unknown) == ({"g1": gp.ReadValues({}, {})}, [])
    child = int(pid_file.read_text())
    try:  # SIGKILL was sent; its death follows: a pidfd turns readable when the process has ended
        pidfd = os.pidfd_open(child)
    except ProcessLookupError:
        return  # ended and reaped already
    try:
        with trio.fail_after(TIMEOUT):  # a child left alive would keep it unreadable
            await trio.lowlevel.wait_readable(pidfd)
    finally:
        os.close(pidfd)


@pytest.mark.slow
async def test_describe_is_given_more_device_ids_than_an_environment_variable_holds(tmp_path):
    ids = [f"gopher-{number:05}" for number in range(16_000)]  # 208 KB joined: over MAX_ARG_STRLEN
    script = program_file(tmp_path, DESCRIBE_GOPHERS)
    resource = dataclasses.replace(gp.parse_config(MINIMAL, "t.yaml").resources[0], describe=(script,))
    with trio.fail_after(TIMEOUT):
        described, unknown = await gp.run_describe(resource, ids)
    assert (len(described), unknown) == (16_000, [])
    assert described["gopher-15999"].attributes == {"model": ("string", "gopher")}


async def test_describe_saved_with_crlf_endings_says_its_first_stderr_line_too(tmp_path):
    script = program_file(tmp_path, "#!/usr/bin/env python3\r\nprint('{}')\r\n")
    resource = dataclasses.replace(gp.parse_config(MINIMAL, "t.yaml").resources[0], describe=(script,))
    with trio.fail_after(TIMEOUT), pytest.raises(gp.DescribeError) as failed:
        await gp.run_describe(resource, ["g1"])
    assert "python3\\r" in str(failed.value).split("(first: ")[1], str(failed.value)


ORPHAN_AS_PID_1 = """
import os, trio
import gopherplug as gp

async def main():
    assert os.getpid() == 1
    ran = await gp.run_program(["sh", "-c", "sleep 300 & echo $!"], os.environ, limit=100)
    orphan = int(ran.stdout)  # killed with its process group, a child of PID 1 now: a zombie until reaped
    with trio.fail_after(10):
        while os.path.exists(f"/proc/{orphan}"):
            await trio.sleep(0.01)  # reaped at SIGCHLD, as it comes
    print("no zombie")

trio.run(gp.serve_until_signalled, main)
"""


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="a PID namespace takes root")
def test_as_pid_1_orphans_are_reaped():
    done = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", ORPHAN_AS_PID_1],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=os.path.dirname(os.path.abspath(gp.__file__)),
    )
    assert (done.returncode, done.stdout) == (0, "no zombie\n"), done.stderr


def test_nfd_label_names_are_ones_nfd_accepts():
    name = gp.nfd_label_name("example.com/gpu", "model_")
    assert re.fullmatch(r"feature\.node\.kubernetes\.io/[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?", name), name
    assert name == gp.nfd_label_name("example.com/gpu", "model_") != gp.nfd_label_name("example.com/gpu", "model")


def test_health_answers_the_absolute_form_of_its_path():
    health = gp.Health()
    for target in (b"http://10.0.0.1:8080/healthz", b"HTTP://node/healthz?verbose", b"/healthz"):
        assert gp.health_answer(health, b"GET " + target + b" HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 200 OK")
    assert gp.health_answer(health, b"GET http://node/other HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 404")


async def test_a_rolling_updates_old_pod_leaves_the_new_pods_nfd_file(nursery, tmp_path):
    """The old pod wrote the file last (its devices changed during the surge) and removes it as it
    stops, as its own: the new pod sees it vanish (inotify) and writes it again."""
    path = str(tmp_path / "features.d" / "gopherplug")
    resource = gp.parse_config(MINIMAL, "t.yaml").resources[0]
    old, new = gp._Served(resource), gp._Served(resource)
    for served in (old, new):
        served.devices.set({"g1": gp.DeviceEntry("g1", "/dev/g1")})
    roster = gp.Watched(None)
    with trio.fail_after(TIMEOUT):
        old_scope = trio.CancelScope()

        async def old_pod():
            with old_scope:
                await gp._keep_nfd_features(path, {"r": old}, roster)

        def inode():
            with contextlib.suppress(OSError):
                return os.stat(path).st_ino

        async def until(condition):  # the writes run in threads: looked at as they land
            while not condition():
                await trio.sleep(0.01)

        nursery.start_soon(old_pod)
        await until(inode)
        first = inode()
        nursery.start_soon(gp._keep_nfd_features, path, {"r": new}, gp.Watched(None))
        await until(lambda: inode() not in (None, first))  # the new pod's own file
        new_text = Path(path).read_text()
        old.devices.set({})  # the old pod's devices change: it writes the file again, so it is its own
        await until(lambda: Path(path).read_text() != new_text)
        with gp.DirectoryWatch(os.path.dirname(path), gp.flags.CREATE | gp.flags.MOVED_TO) as watch:
            old_scope.cancel()  # the old pod stops, and removes the file it wrote
            async with contextlib.aclosing(watch.batches()) as batches:
                async for _ in batches:
                    if os.path.exists(path) and Path(path).read_text() == new_text:
                        break


INVALID_DESCRIBED = {
    "name": ({"attributes": {"gpu-model": "H200"}}, "attributes.gpu-model", "'gpu-model' must be a C identifier"),
    "slashes": ({"attributes": {"a/b/c": "x"}}, "attributes.a/b/c", "must be either a C identifier or a domain"),
    "domain": ({"attributes": {"-x-/model": "x"}}, "attributes.-x-/model", "must be a DNS subdomain"),
    "string": ({"attributes": {"serial": "x" * 65}}, "attributes.serial", "has 65 bytes"),
    "version": ({"attributes": {"driverVersion": {"version": "580.159"}}}, "attributes.driverVersion", "semantic"),
    "int": ({"attributes": {"cores": 2**64}}, "attributes.cores", "does not fit in 64 bits"),
    "type": ({"attributes": {"ratio": 1.5}}, "attributes.ratio", "1.5 is not a string, a whole number"),
    "quantity": ({"capacity": {"memory": "80GB"}}, "capacity.memory", "'80GB' is not a quantity"),
    "too many": ({"attributes": {f"a{n}": n for n in range(30)}}, "attributes.a29", "at most 32 attributes"),
}


@pytest.mark.parametrize("kind", list(INVALID_DESCRIBED))
async def test_dra_a_described_value_the_api_server_would_refuse_is_one_line_not_a_refused_slice(
    dra_node, kind, caplog
):
    """The strict API server stand-in refuses a slice with each kind of invalid value, as
    the API server does (one bad device refuses the whole pool); gopherplug, given one by describe,
    leaves it out with one line naming the resource, the device and the key, and writes a slice the
    stand-in takes, with the device's other values."""
    described, key, why = INVALID_DESCRIBED[kind]
    (dra_node.devices / "gopher0").touch()
    script = dra_node.root / "describe"
    described = {**described, "attributes": {"uuid": "GPU-0", **described.get("attributes", {})}}
    script.write_text(f"#!{sys.executable}\nimport json\nprint(json.dumps({json.dumps({'gopher0': described})}))\n")
    script.chmod(0o755)
    with trio.fail_after(TIMEOUT), caplog.at_level("INFO", logger="gopherplug"):
        await dra_node.start(dra_node.config(describe=[str(script)]))
        await dra_node.registered()
        while not any("uuid" in d["attributes"] for s in dra_node.api.slices.values() for d in s["spec"]["devices"]):
            await dra_node.api.changed.wait_touched()
    assert dra_node.api.refused == []
    [line] = [line for line in caplog.messages if key in line]
    assert line.startswith(f"example.com/gopher: device gopher0: {key}: ") and why in line, line
    # The same value written as is: what the API server says of it.
    (item,) = dra_node.api.slices.values()
    device = item["spec"]["devices"][0]
    group = key.split(".", 1)[0]
    value = described[group][key.split(".", 1)[1]]
    if group == "capacity":
        device.setdefault("capacity", {})[key.split(".", 1)[1]] = {"value": value}
    else:
        typed = {str: "string", float: "int", int: "int"}
        device["attributes"].update(
            {n: v if isinstance(v, dict) else {typed[type(v)]: v} for n, v in described["attributes"].items()}
        )
    assert standins.resource_slice_causes(item), kind


@pytest.mark.slow
async def test_dra_a_reload_runs_describe_again_keeping_what_it_said_meanwhile(dra_node, monkeypatch):
    """describe runs again on a reload, even of an unchanged resource (what it says may
    change with no device coming or going); the new watch publishes the devices as last described
    until it has, so the slice is written once, with the new value, never without one."""
    calls = described_calls(monkeypatch)
    (dra_node.devices / "gopher0").touch()
    value = dra_node.root / "value"
    value.write_text("GPU-1")
    script = dra_node.root / "describe"
    script.write_text(
        f"#!{sys.executable}\nimport json\n"
        f"print(json.dumps({{'gopher0': {{'attributes': {{'uuid': open({str(value)!r}).read()}}}}}}))\n"
    )
    script.chmod(0o755)
    config = dra_node.config(describe=[str(script)])
    send, receive = trio.open_memory_channel(1)

    async def updates():
        async for new in receive:
            yield new

    def uuid():
        (item,) = dra_node.api.slices.values()
        return item["spec"]["devices"][0]["attributes"].get("uuid")

    with trio.fail_after(TIMEOUT), logged("configuration reloaded: ") as reloaded:
        await dra_node.start(config, updates=lambda _: updates())
        await dra_node.registered()
        while uuid() != {"string": "GPU-1"}:
            await dra_node.api.changed.wait_touched()
        writes = len(dra_node.api.writes)
        value.write_text("GPU-2")
        await send.send(config)  # the same configuration, read again
        await reloaded.wait()
        while uuid() != {"string": "GPU-2"}:
            await dra_node.api.changed.wait_touched()
    assert calls.value == 2
    assert reloaded.lines == ["cfg.yaml: configuration reloaded: described again example.com/gopher"]
    assert [verb for verb, _ in dra_node.api.writes[writes:]] == ["update"]


async def test_dra_cdi_spec_gives_the_host_mode_and_follows_a_chmod_without_touching_the_slices(dra_node):
    """A DRA device reaches a container only through the CDI spec: its nodes have the host's mode
    and owner there too, and a chmod rewrites the spec, not the pool (a new generation for nothing)."""
    device = dra_node.devices / "gopher0"
    device.touch()
    device.chmod(0o660)
    cdi_dir = dra_node.root / "cdi"
    config = dra_node.config(
        cdi={"kind": "example.com/gopher", "spec_dir": str(cdi_dir)},
        device_specs=[{"host_path": "{path}", "container_path": "/dev/{id}"}],  # a file, as a node would be
    )

    def mode():
        [described] = read_spec(cdi_dir / "example.com-gopher.json")["devices"]
        return [(node["fileMode"], node["uid"], node["gid"]) for node in described["containerEdits"]["deviceNodes"]]

    with trio.fail_after(TIMEOUT):
        await dra_node.start(config)
        await dra_node.registered()
        await dra_node.wait_for_slices(["gopher0"])
        assert mode() == [(0o660, os.geteuid(), os.getegid())]
        writes = len(dra_node.api.writes)
        watcher = INotify()
        watcher.add_watch(str(cdi_dir), inotify_flags.MOVED_TO)
        try:
            device.chmod(0o600)
            await trio.lowlevel.wait_readable(watcher.fileno())  # the spec replaced
        finally:
            trio.lowlevel.notify_closing(watcher.fileno())
            watcher.close()
        assert mode() == [(0o600, os.geteuid(), os.getegid())]
        await trio.testing.wait_all_tasks_blocked()
    assert len(dra_node.api.writes) == writes and dra_node.slice_devices() == (["gopher0"], {1})


@pytest.mark.slow
async def test_dra_claim_prepared_unprepared_and_kept_across_a_plugin_restart(dra_node):
    (dra_node.devices / "gopher0").touch()
    allocated = ("gopher", DRIVER, DraNode.POOL, "gopher0")
    dra_node.api.put_claim(claim("c1", "uid-1", allocated))
    dra_node.api.put_claim(claim("c2", "uid-2", allocated))
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.registered()
        await dra_node.wait_for_slices(["gopher0"])
        answer = await dra_node.kubelet.prepare(DRIVER, [("default", "uid-1", "c1")])
        expected = {
            "uid-1": {
                "devices": [
                    {
                        "requestNames": ["gopher"],
                        "poolName": DraNode.POOL,
                        "deviceName": "gopher0",
                        # The device's, and its request's env (in the claim's own spec).
                        "cdiDeviceIds": ["example.com/gopher=gopher0", "example.com/gopher=uid-1_gopher"],
                    }
                ]
            }
        }
        assert MessageToDict(answer)["claims"] == expected
        spec = json.loads((dra_node.root / "cdi" / "example.com-gopher.json").read_text())
        assert [d["name"] for d in spec["devices"]] == ["gopher0"]  # the CDI device exists before the answer
        own = read_spec(dra_node.root / "cdi" / "example.com-gopher_uid-1.json")["devices"]
        assert own == [{"name": "uid-1_gopher", "containerEdits": {"env": ["GOPHER_DEVICES=gopher0"]}}]
        await dra_node.kubelet.prepare(DRIVER, [("default", "uid-2", "c2")])
        # The plugin restarts; the kubelet prepares c1 again (the same answer, not asked of the API
        # server) and unprepares c2, which only the checkpoint remembers.
        dra_node.stop()
        await dra_node.kubelet.wait_until(lambda k: DRIVER not in k.drivers)
        dra_node.api.claims.clear()
        await dra_node.start()
        await dra_node.registered()
        again = await dra_node.kubelet.prepare(DRIVER, [("default", "uid-1", "c1")])
        assert MessageToDict(again)["claims"] == expected
        with logged("unprepared ResourceClaim") as unprepared:
            claims = [("default", "uid-2", "c2"), ("default", "uid-9", "c9")]
            gone = await dra_node.kubelet.unprepare(DRIVER, claims)
        assert unprepared.lines == ["unprepared ResourceClaim default/c2 (uid-2)"]  # c9 was never prepared here
        assert sorted(gone.claims) == ["uid-2", "uid-9"]
        assert all(not entry.error for entry in gone.claims.values())
    checkpoint = json.loads((dra_node.kubelet_dir / "plugins" / DRIVER / "checkpoint.json").read_text())
    assert sorted(checkpoint["claims"]) == ["uid-1"]
    # c2's own spec went with it, named by the checkpoint alone across the restart; c1's stays.
    assert sorted(glob.glob("*_uid-*.json", root_dir=dra_node.root / "cdi")) == ["example.com-gopher_uid-1.json"]


def metadata_stream(text):
    """The objects of a device metadata file, a JSON stream, in order (as a consumer walks it)."""
    decoder, objects, at = json.JSONDecoder(), [], 0
    while at < len(text):
        found, at = decoder.raw_decode(text, at)
        objects.append(found)
        at += len(text[at:]) - len(text[at:].lstrip())
    return objects


@pytest.mark.slow
async def test_dra_device_metadata_is_mounted_read_only_through_the_claims_cdi_spec_and_removed_at_unprepare(
    dra_node,
):
    """KEP-5304, on by default: a claim prepared through the kubelet gets, for each request, a CDI
    device that bind-mounts its metadata file read-only at the path the protocol gives ("resourceclaims/
    <claim>/<request>/<driver>-metadata.json", or "resourceclaimtemplates/<pod's name for it>/..." for a
    claim made from a template). The host file is a stream of DeviceMetadata, v1beta1 then v1alpha1,
    whose devices carry the attributes the API server holds in the ResourceSlice. Unprepare removes a
    claim's files and spec; at start, files no checkpointed claim names are removed."""
    for name in ("gopher0", "gopher1"):
        (dra_node.devices / name).touch()
    dra_node.api.put_claim(claim("c1", "uid-1", ("gopher", DRIVER, DraNode.POOL, "gopher1")))
    from_template = claim("pod-0-gpus-x7k2p", "uid-2", ("gpu/small", DRIVER, DraNode.POOL, "gopher0"))
    from_template["metadata"]["annotations"] = {"resource.kubernetes.io/pod-claim-name": "gpus"}
    from_template["spec"]["devices"]["requests"] = PRIORITIZED_REQUESTS
    dra_node.api.put_claim(from_template)
    config = dra_node.config(device_metadata=None)  # the default
    cdi_dir = Path(dra_node.cdi["spec_dir"])
    metadata_dir = dra_node.kubelet_dir / "plugins" / DRIVER / "dra-device-metadata"
    stray = metadata_dir / "default_gone_uid-9" / "gopher" / "metadata.json"  # a claim no checkpoint names
    stray.parent.mkdir(parents=True)
    stray.write_text("{}")
    with trio.fail_after(TIMEOUT):
        with logged("the device metadata of a claim") as swept:
            await dra_node.start(config)
            await dra_node.registered()  # the sweep comes before the registration
        await dra_node.wait_for_slices(["gopher0", "gopher1"])
        claims = [("default", "uid-1", "c1"), ("default", "uid-2", "pod-0-gpus-x7k2p")]
        answer = await dra_node.kubelet.prepare(DRIVER, claims)
    assert swept.lines == [
        f"removed {stray.parent.parent}, the device metadata of a claim that is not prepared any more"
    ]
    assert {uid: entry.error for uid, entry in answer.claims.items()} == {"uid-1": "", "uid-2": ""}
    mounts = {"uid-1": ("c1", "gopher", "gopher1"), "uid-2": ("pod-0-gpus-x7k2p", "gpu", "gopher0")}
    for uid, (name, request, device) in mounts.items():
        # The kubelet gives the container that names the request the device, its request's env and its
        # metadata's mount.
        assert dra_node.kubelet.cdi_devices(uid, request) == [
            f"example.com/gopher={device}",
            f"example.com/gopher={uid}_{request}",
            f"{DRIVER}/metadata={uid}_{request}",
        ]
        spec = read_spec(cdi_dir / f"{DRIVER}-metadata_{uid}.json")
        assert cdi_problem(spec["cdiVersion"], spec) is None
        assert (spec["kind"], [d["name"] for d in spec["devices"]]) == (f"{DRIVER}/metadata", [f"{uid}_{request}"])
        [mount] = spec["devices"][0]["containerEdits"]["mounts"]
        host = metadata_dir / f"default_{name}_{uid}" / request / "metadata.json"
        inside = "resourceclaims/c1" if uid == "uid-1" else "resourceclaimtemplates/gpus"
        assert mount == {
            "hostPath": str(host),
            "containerPath": f"/var/run/kubernetes.io/dra-device-attributes/{inside}/{request}/{DRIVER}-metadata.json",
            "options": ["ro", "bind"],
        }
        assert stat.S_IMODE(host.stat().st_mode) == 0o644
        text = host.read_text()
        assert text.startswith('{\n  "kind": "DeviceMetadata",\n  "apiVersion": "metadata.resource.k8s.io/v1beta1",\n')
        beta, alpha = metadata_stream(text)
        assert alpha == {**beta, "apiVersion": "metadata.resource.k8s.io/v1alpha1"}
        [published] = [d for s in dra_node.api.slices.values() for d in s["spec"]["devices"] if d["name"] == device]
        expected = {
            "kind": "DeviceMetadata",
            "apiVersion": "metadata.resource.k8s.io/v1beta1",
            "metadata": {"name": name, "namespace": "default", "uid": uid, "generation": 1},
            **({"podClaimName": "gpus"} if uid == "uid-2" else {}),
            "requests": [
                {
                    # The subrequest the scheduler chose is in the file; the path has its request.
                    "name": "gopher" if uid == "uid-1" else "gpu/small",
                    "devices": [
                        {"driver": DRIVER, "pool": DraNode.POOL, "name": device, "attributes": published["attributes"]}
                    ],
                }
            ],
        }
        assert beta == expected
    assert published["attributes"]["id"] == {"string": "gopher0"}  # the device's own, not just any
    # Prepared again (answered from the checkpoint): a metadata file that went missing is written again.
    kept = host.read_text()
    host.unlink()
    with trio.fail_after(TIMEOUT):
        again = await dra_node.kubelet.prepare(DRIVER, claims[1:])
        assert (again.claims["uid-2"].error, host.read_text()) == ("", kept)
        gone = await dra_node.kubelet.unprepare(DRIVER, [("default", "uid-1", "c1")])
        dra_node.stop()
    assert not gone.claims["uid-1"].error
    assert sorted(os.listdir(metadata_dir)) == ["default_pod-0-gpus-x7k2p_uid-2"]  # c1's went, c2's stays
    assert not (cdi_dir / f"{DRIVER}-metadata_uid-1.json").exists()
    assert (cdi_dir / f"{DRIVER}-metadata_uid-2.json").exists()


async def test_dra_device_metadata_turned_off_mounts_nothing_and_writes_nothing(dra_node):
    """dra.device_metadata: false: the answer names the device's CDI device and its request's env
    alone, and neither a metadata file nor its CDI spec is written."""
    (dra_node.devices / "gopher0").touch()
    dra_node.api.put_claim(claim("c1", "uid-1", ("gopher", DRIVER, DraNode.POOL, "gopher0")))
    config = dra_node.config(device_metadata=False)
    assert config.dra.device_metadata is False
    with trio.fail_after(TIMEOUT):
        await dra_node.start(config)
        await dra_node.registered()
        await dra_node.wait_for_slices(["gopher0"])
        answer = (await dra_node.kubelet.prepare(DRIVER, [("default", "uid-1", "c1")])).claims["uid-1"]
        dra_node.stop()
    assert (answer.error, [list(d.cdi_device_ids) for d in answer.devices]) == (
        "",
        [["example.com/gopher=gopher0", "example.com/gopher=uid-1_gopher"]],
    )
    assert not (dra_node.kubelet_dir / "plugins" / DRIVER / "dra-device-metadata").exists()
    assert sorted(glob.glob("*.json", root_dir=dra_node.cdi["spec_dir"])) == [
        "example.com-gopher.json",
        "example.com-gopher_uid-1.json",
    ]


def test_dra_device_metadata_key_is_true_or_false_and_its_cdi_kind_is_its_own():
    with pytest.raises(gp.ConfigError) as refused:
        gp.parse_config(dra_config("/g", "/k", device_metadata="no"), "cfg.yaml")
    assert str(refused.value) == (
        "cfg.yaml: dra.device_metadata: 'no': must be true (the default: each claim's containers get a file "
        "describing their devices) or false"
    )
    with pytest.raises(gp.ConfigError) as taken:
        gp.parse_config(dra_config("/g", "/k", device_metadata=None, name="example.com/metadata"), "cfg.yaml")
    assert str(taken.value) == (
        f"cfg.yaml: resources[0].name: '{DRIVER}/metadata' is the CDI kind of the device metadata gopherplug mounts "
        "into claims' containers (dra.device_metadata): give the resource another cdi.kind"
    )
    # Turned off, the kind is free.
    parsed = gp.parse_config(dra_config("/g", "/k", name="example.com/metadata"), "cfg.yaml")
    assert parsed.resources[0].cdi.kind == f"{DRIVER}/metadata"


@pytest.mark.slow
async def test_dra_shares_of_one_device_get_cdi_devices_of_their_own_kept_across_a_restart(dra_node):
    """replicas: 3 under DRA: three claims, each allocated one share of gopher0 (a shareID each, as
    the scheduler writes them), are prepared with a CDI device per share, "<id>-<shareID>", in a
    spec file of the claim's own: the device's edits plus <ENV>_<ID>_SHARE. The answer carries the
    shareID. Prepared again, the same answer. Across a plugin restart the checkpoint still names
    each claim's spec: an unprepare removes it, and a prepare after a reboot (the spec directory
    is a tmpfs) writes it again. The claims' status entries name their shares."""
    (dra_node.devices / "gopher0").touch()
    cdi_dir = dra_node.root / "cdi"
    config = dra_node.config(replicas=3, device_specs=[{"host_path": "{path}", "container_path": "/dev/{id}"}])
    shares = {"uid-1": SHARE_1, "uid-2": SHARE_2, "uid-3": SHARE_3}
    for number, (uid, share) in enumerate(shares.items(), 1):
        result = ("gopher", DRIVER, DraNode.POOL, "gopher0", {"shareID": share, "consumedCapacity": {"shares": "1"}})
        dra_node.api.put_claim(claim(f"c{number}", uid, result))
    claims = [("default", uid, f"c{number}") for number, uid in enumerate(shares, 1)]

    def claim_spec(uid):
        return cdi_dir / f"example.com-gopher_{uid}.json"

    with trio.fail_after(TIMEOUT):
        await dra_node.start(config)
        await dra_node.registered()
        await dra_node.wait_for_slices(["gopher0"])
        answer = MessageToDict(await dra_node.kubelet.prepare(DRIVER, claims))["claims"]
        assert answer == {
            uid: {
                "devices": [
                    {
                        "requestNames": ["gopher"],
                        "poolName": DraNode.POOL,
                        "deviceName": "gopher0",
                        "cdiDeviceIds": [f"example.com/gopher=gopher0-{share}", f"example.com/gopher={uid}_gopher"],
                        "shareId": share,
                    }
                ]
            }
            for uid, share in shares.items()
        }
        for uid, share in shares.items():
            env, described = read_spec(claim_spec(uid))["devices"]
            # The request's env: the device once, as Allocate lists a device, not its replicas.
            assert env == {"name": f"{uid}_gopher", "containerEdits": {"env": ["GOPHER_DEVICES=gopher0"]}}
            assert described["name"] == f"gopher0-{share}"
            assert described["containerEdits"]["env"] == [
                "GOPHER_DEVICES_GOPHER0=gopher0",
                f"GOPHER_DEVICES_GOPHER0_SHARE={share}",
            ]
            assert [n["path"] for n in described["containerEdits"]["deviceNodes"]] == ["/dev/gopher0"]
        # The resource's own spec is the device, as before
        assert [d["name"] for d in read_spec(cdi_dir / "example.com-gopher.json")["devices"]] == ["gopher0"]
        again = MessageToDict(await dra_node.kubelet.prepare(DRIVER, claims[:1]))["claims"]
        assert again == {"uid-1": answer["uid-1"]}
        while len(dra_node.api.status_writes) < 3:
            await dra_node.api.changed.wait_touched()
        assert [dra_node.api.claims["default", f"c{n}"]["status"]["devices"][0]["shareID"] for n in (1, 2, 3)] == [
            SHARE_1,
            SHARE_2,
            SHARE_3,
        ]
        dra_node.stop()
        await dra_node.kubelet.wait_until(lambda k: DRIVER not in k.drivers)
        dra_node.api.claims.clear()  # the checkpoint alone answers now
        claim_spec("uid-1").unlink()  # a reboot emptied the spec directory
        await dra_node.start(config)
        await dra_node.registered()
        after = MessageToDict(await dra_node.kubelet.prepare(DRIVER, claims[:1]))["claims"]
        assert after == {"uid-1": answer["uid-1"]}
        assert [d["name"] for d in read_spec(claim_spec("uid-1"))["devices"]] == ["uid-1_gopher", f"gopher0-{SHARE_1}"]
        gone = await dra_node.kubelet.unprepare(DRIVER, claims[1:2])
        assert not gone.claims["uid-2"].error
    assert sorted(os.listdir(cdi_dir)) == [
        ".example.com-gopher.json.lock",  # one lock for the kind's specs: none left behind per claim
        "example.com-gopher.json",
        "example.com-gopher_uid-1.json",
        "example.com-gopher_uid-3.json",
    ]
    checkpoint = json.loads((dra_node.kubelet_dir / "plugins" / DRIVER / "checkpoint.json").read_text())
    assert sorted(checkpoint["claims"]) == ["uid-1", "uid-3"]


def registered_throughout(events, driver_sockets):
    """Whether, from the first registration on, some plugin of the driver was registered at every
    event: the kubelet's registrations and deregistrations replayed in their order."""
    count, began = 0, False
    for event, path in events:
        if path in driver_sockets and event in ("registered", "deregistered"):
            count += 1 if event == "registered" else -1
            began |= count > 0
            if began and count == 0:
                return False
    return began


@pytest.mark.slow
@pytest.mark.parametrize("dra_node", standins.KUBERNETES_VERSIONS, indirect=True)
async def test_dra_a_batch_with_a_failing_claim_gives_the_others_devices_once(dra_node):
    """The 1.36 kubelet sends a pod's claims in one batch, and after any claim's
    error sends the whole batch again, appending the devices of each claim answered without an
    error at every try (the stand-in does as it does). So no claim's devices go out while another
    of the batch fails: the retry answers the prepared one again from the checkpoint, and the
    container gets its CDI device once, `who` its holder once."""
    (dra_node.devices / "gopher0").touch()
    (dra_node.devices / "gopher1").touch()
    dra_node.api.put_claim(claim("c0", "uid-0", ("gopher", DRIVER, DraNode.POOL, "gopher0")))
    batch = [("default", "uid-0", "c0"), ("default", "uid-1", "c1")]  # c1 not on the API server yet
    kubelet = dra_node.kubelet
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.registered()
        await dra_node.wait_for_slices(["gopher0", "gopher1"])
        for _ in range(2):  # the kubelet's tries, while c1 cannot be prepared
            first = (await kubelet.prepare(DRIVER, batch)).claims
            assert first["uid-1"].error and not first["uid-1"].devices
            assert first["uid-0"].error == (
                f"held back until ResourceClaim default/c1 (uid-1) of the same request is prepared too: "
                f"{first['uid-1'].error}"
            )
            assert list(first["uid-0"].devices) == []
        dra_node.api.put_claim(claim("c1", "uid-1", ("gopher", DRIVER, DraNode.POOL, "gopher1")))
        answers = (await kubelet.prepare(DRIVER, batch)).claims  # the retry: the whole batch
    assert [(answers[uid].error, [d.device_name for d in answers[uid].devices]) for uid in ("uid-0", "uid-1")] == [
        ("", ["gopher0"]),
        ("", ["gopher1"]),
    ]
    assert kubelet.cdi_devices("uid-0") == ["example.com/gopher=gopher0", "example.com/gopher=uid-0_gopher"]
    assert kubelet.cdi_devices("uid-1") == ["example.com/gopher=gopher1", "example.com/gopher=uid-1_gopher"]


def test_who_lists_a_holder_once_when_the_kubelet_lists_a_claims_device_twice():
    """A kubelet that retried a batch (with a driver that answers a batch's
    claims one by one) holds a claim's devices once per try, and PodResources lists each as often."""
    (resource,) = gp.parse_config(dra_config("/g", "/k"), "cfg.yaml").resources
    device = gp.DeviceEntry("gopher0", "/g/gopher0")
    pool = gp.dra_pool_name("node-1", resource.name)
    result = gp.podresourcespb.ClaimResource(driver_name=DRIVER, pool_name=pool, device_name="gopher0")
    dynamic = gp.podresourcespb.DynamicResource(
        claim_name="c0", claim_namespace="default", claim_resources=[result, result]
    )
    container = gp.podresourcespb.ContainerResources(name="worker", dynamic_resources=[dynamic])
    pod = gp.podresourcespb.PodResources(name="trainer", namespace="default", containers=[container])
    (held,) = gp.device_holders([(resource, [device])], [pod], DRIVER, "node-1")
    assert held.holders == (gp.Holder("default", "trainer", "worker", "claim default/c0"),)


@pytest.mark.slow
async def test_dra_two_pods_of_a_rolling_update_overlap_with_a_driver_registered_throughout(dra_node, monkeypatch):
    """maxSurge: 1: the new pod starts while the old one serves and holds everything (the CDI spec,
    the checkpoint, the slices). Both register; a claim prepared during the overlap goes to the
    newest; the old pod stops; the new one unprepares every claim, those the old one prepared too.
    At no moment is the driver without a registered plugin, and its slices are never wiped. The
    same on every release (kubelets register two plugins of one driver since 1.33)."""
    (dra_node.devices / "gopher0").touch()
    (dra_node.devices / "gopher1").touch()
    for name, uid, device in (("c0", "uid-0", "gopher0"), ("c1", "uid-1", "gopher1")):
        dra_node.api.put_claim(claim(name, uid, ("gopher", DRIVER, DraNode.POOL, device)))
    old_config = gp.with_pod_uid(dra_node.config(), "0a1b2c3d-0000-4000-8000-00000000001a")
    new_config = gp.with_pod_uid(dra_node.config(), "0a1b2c3d-0000-4000-8000-00000000002b")
    old_socket, new_socket = old_config.dra.registration_socket, new_config.dra.registration_socket
    kubelet = dra_node.kubelet
    # Every step waits on an event; the bound only stops a hang: two pods start and one stops here,
    # each seconds of work on a loaded machine.
    with trio.fail_after(3 * TIMEOUT):
        old = await dra_node.start(old_config)
        await kubelet.wait_until(lambda k: [p.registration_socket for p in k.plugins.get(DRIVER, [])] == [old_socket])
        await dra_node.wait_for_slices(["gopher0", "gopher1"])
        c0 = (await kubelet.prepare(DRIVER, [("default", "uid-0", "c0")])).claims["uid-0"]
        assert (c0.error, [d.device_name for d in c0.devices]) == ("", ["gopher0"])
        await dra_node.start(new_config)  # refused before: the old pod held the CDI spec's lock
        await kubelet.wait_until(lambda k: len(k.plugins.get(DRIVER, [])) == 2)
        assert kubelet.drivers[DRIVER].registration_socket == new_socket  # the newest gets the calls
        c1 = (await kubelet.prepare(DRIVER, [("default", "uid-1", "c1")])).claims["uid-1"]
        assert (c1.error, [d.device_name for d in c1.devices]) == ("", ["gopher1"])
        assert kubelet.cdi_devices("uid-1") == ["example.com/gopher=gopher1", "example.com/gopher=uid-1_gopher"]
        checkpoint = dra_node.kubelet_dir / "plugins" / DRIVER / "checkpoint.json"
        assert sorted(json.loads(checkpoint.read_text())["claims"]) == ["uid-0", "uid-1"]
        kubelet.wiping_delay = 0  # a wipe, were it due, would come at once
        old.cancel()  # the DaemonSet controller deletes the old pod once the new one is available
        await kubelet.wait_until(lambda k: [p.registration_socket for p in k.plugins.get(DRIVER, [])] == [new_socket])
        # Its registration socket goes first, then the rest of it: what it leaves behind (sockets,
        # CDI spec, slices) is known once every part of it has stopped, not at its deregistration.
        await dra_node.ended[old].wait()
        with logged("unprepared ResourceClaim") as unprepared:
            gone = await kubelet.unprepare(DRIVER, [("default", "uid-0", "c0"), ("default", "uid-1", "c1")])
        assert [(uid, answer.error) for uid, answer in sorted(gone.claims.items())] == [("uid-0", ""), ("uid-1", "")]
        assert sorted(unprepared.lines) == [
            "unprepared ResourceClaim default/c0 (uid-0)",  # prepared by the old pod
            "unprepared ResourceClaim default/c1 (uid-1)",
        ]
        await dra_node.wait_for_slices(["gopher0", "gopher1"])
    assert json.loads(checkpoint.read_text())["claims"] == {}
    assert registered_throughout(kubelet.events, {old_socket, new_socket})
    assert ("deregistered", old_socket) in kubelet.events and ("wiped", DRIVER) not in kubelet.events
    # Only the old pod's sockets went; the CDI spec the new one keeps is there.
    assert sorted(os.listdir(dra_node.kubelet_dir / "plugins_registry")) == [os.path.basename(new_socket)]
    assert sorted(p.name for p in (dra_node.kubelet_dir / "plugins" / DRIVER).iterdir()) == [
        "checkpoint.json",
        "dra-0a1b2c3d-0000-4000-8000-00000000002b.sock",
        "serialize.lock",
    ]
    assert [d["name"] for d in read_spec(dra_node.root / "cdi" / "example.com-gopher.json")["devices"]] == [
        "gopher0",
        "gopher1",
    ]


def dead_socket(path):
    """A unix socket file that nothing listens on: what a process killed by SIGKILL leaves."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with socket.socket(socket.AF_UNIX) as bound:
        bound.bind(str(path))
    return path


@pytest.mark.slow
async def test_dra_sockets_left_by_a_killed_pod_are_removed_and_others_kept(dra_node):
    """A pod killed before it removed its sockets leaves them: the kubelet would try the
    registration socket at every start, and keep the dead endpoint among the driver's plugins. The
    next driver removes the driver's sockets nobody listens on; a live one and other drivers' stay."""
    registry = dra_node.kubelet_dir / "plugins_registry"
    plugins = dra_node.kubelet_dir / "plugins" / DRIVER
    with trio.fail_after(TIMEOUT):
        await dra_node.start(gp.with_pod_uid(dra_node.config(), "0a1b2c3d-0000-4000-8000-00000000003c"))
        await dra_node.kubelet.wait_until(lambda k: len(k.plugins.get(DRIVER, [])) == 1)
        dead = [
            dead_socket(registry / f"{DRIVER}-0a1b2c3d-0000-4000-8000-00000000004d-reg.sock"),
            dead_socket(plugins / "dra-0a1b2c3d-0000-4000-8000-00000000004d.sock"),
        ]
        other = dead_socket(registry / "other.example.com-reg.sock")
        with logged("left by a DRA driver that did not exit cleanly") as removed:
            await dra_node.start(gp.with_pod_uid(dra_node.config(), "0a1b2c3d-0000-4000-8000-00000000002b"))
        await dra_node.kubelet.wait_until(lambda k: len(k.plugins.get(DRIVER, [])) == 2)
    assert not any(path.exists() for path in dead)
    assert sorted(removed.lines) == sorted(
        f"removed {path}, left by a DRA driver that did not exit cleanly" for path in dead
    )
    assert other.exists()  # not this driver's
    assert sorted(os.listdir(registry)) == sorted(
        [
            "other.example.com-reg.sock",
            f"{DRIVER}-0a1b2c3d-0000-4000-8000-00000000003c-reg.sock",
            f"{DRIVER}-0a1b2c3d-0000-4000-8000-00000000002b-reg.sock",
        ]
    )


def test_dra_another_driver_whose_name_extends_ours_is_neither_a_peer_nor_removed(sockdir):
    """A driver named gopherplug.example.com-nic has sockets that begin with
    our name and a "-". Its live socket is no newer pod of ours (we would stop publishing), its dead
    one is not ours to remove: only "<driver>-<pod UID>-reg.sock" with a UUID (or the 11-character
    digest the name falls back to) is one of ours."""
    config = gp.DraConfig(DRIVER, kubelet_dir=sockdir, pod_uid=POD_UID)
    registry = Path(sockdir) / "plugins_registry"
    ours = dead_socket(Path(config.registration_socket))
    other_uid = "fa1b2c3d-0000-4000-8000-0000000000ff"  # made later, and sorts after ours on a tie
    with contextlib.ExitStack() as stack:
        for name in (f"{DRIVER}-nic-reg.sock", f"{DRIVER}-nic-{other_uid}-reg.sock"):
            live = stack.enter_context(socket.socket(socket.AF_UNIX))
            live.bind(str(registry / name))
            live.listen()
        assert gp.DriverPeers(config).newer() == ("", False)
        newer = stack.enter_context(socket.socket(socket.AF_UNIX))
        newer.bind(str(registry / f"{DRIVER}-{other_uid}-reg.sock"))
        newer.listen()
        assert gp.DriverPeers(config).newer() == (str(registry / f"{DRIVER}-{other_uid}-reg.sock"), False)
        # Not asked yet whether the kubelet registered it: no pod that prepares claims.
        assert gp.DriverPeers(config).newer(registered=True) == ("", True)
    # Closed now: what each pod leaves when killed.
    theirs = [registry / f"{DRIVER}-nic-reg.sock", registry / f"{DRIVER}-nic-{other_uid}-reg.sock"]
    mine = registry / f"{DRIVER}-{other_uid}-reg.sock"
    gp._remove_dead_sockets(config)
    assert all(path.exists() for path in theirs) and ours.exists() and not mine.exists()


async def test_dra_a_second_driver_without_a_pod_uid_is_refused_while_the_first_serves(dra_node):
    """Without POD_UID both would serve on the same socket paths, each replacing the other's."""
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.registered()
        with pytest.raises(gp.GopherplugError) as info, gp._unwrap_single_errors():
            async with trio.open_nursery() as second:
                await second.start(functools.partial(gp.serve_plugin, dra_node.config(), node_name="node-1"))
    registration = dra_node.kubelet_dir / "plugins_registry" / f"{DRIVER}-reg.sock"
    assert str(gp._innermost(info.value)) == (
        f"DRA driver {DRIVER} is already served on this node ({registration} answers): stop that one, or give "
        "each its pod's UID in POD_UID to run two at once (a rolling update)"
    )
    assert [p.registration_socket for p in dra_node.kubelet.plugins[DRIVER]] == [str(registration)]
