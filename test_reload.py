"""Configuration hot reload: in place, anew, refused."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
from pathlib import Path

import pytest
import trio
import trio.socket
import trio.testing

import gopherplug as gp
from testsupport import (
    MINIMAL,
    OTHER,
    RESOURCE,
    TIMEOUT,
    config_text,
    devices_of,
    listed,
    listed_ids,
    logged,
    read_spec,
    reloading,
    replace_file,
    streaming,
)

# ------------------------------------------------------------------------------------------------
# Configuration hot reload: the file watched with inotify, changes applied while serving
# ------------------------------------------------------------------------------------------------


@pytest.mark.slow
async def test_reload_adds_changes_and_removes_resources(nursery, node, tmp_path, caplog):
    path = tmp_path / "gopherplug.yaml"
    path.write_text(config_text(node, **{RESOURCE: {}}))
    with trio.fail_after(TIMEOUT):
        simulator = await reloading(nursery, node, path)
        # Written in place, as an editor may: a reading between the truncation and the write (an
        # empty file, refused) is followed by the write's own, so the test waits for what it applies.
        path.write_text(config_text(node, **{RESOURCE: {}, OTHER: {"pattern": "g1"}}))
        await simulator.wait_until(lambda s: streaming(s, OTHER) == {"g1": gp.HEALTHY})
        assert [r.resource_name for r in simulator.registrations] == [RESOURCE, OTHER]

        with logged("invalid YAML") as invalid:  # (read in a worker thread: waited for by its line)
            replace_file(path, "resources: [")  # invalid: logged, nothing changes
            await invalid.wait()
        assert f"{path}: invalid YAML (line 1, column 13: " in caplog.text
        assert caplog.text.rstrip().endswith("; keeping the running configuration")
        with logged("configuration reloaded: ") as reloaded:
            replace_file(path, config_text(node, **{RESOURCE: {"env": "GOPHERS"}, OTHER: {"pattern": "g1"}}))
            await reloaded.wait()
        assert reloaded.lines == [f"{path}: configuration reloaded: updated in place {RESOURCE}"]
        answer = await simulator.allocate(RESOURCE, ["g1"])
        assert dict(answer.container_responses[0].envs) == {"GOPHERS": "g1"}

        other_updates = simulator.resources[OTHER].updates
        replace_file(path, config_text(node, **{RESOURCE: {"env": "GOPHERS"}}))
        await simulator.wait_until(lambda s: not s.resources[OTHER].streaming)
        await trio.testing.wait_all_tasks_blocked()  # its server stopped too
    # Its goodbye was an empty list, then its stream ended and its socket went.
    assert simulator.resources[OTHER].updates == other_updates + 1
    assert simulator.resources[OTHER].devices == {}
    assert node.our_sockets() == ["gopherplug-example.com_gopher-1.sock"]
    assert [r.resource_name for r in simulator.registrations] == [RESOURCE, OTHER], "an env change registers nothing"


async def test_reload_of_a_fixed_file_says_it_is_valid_again_and_what_was_applied(nursery, node, tmp_path):
    """Issue: after an invalid file was fixed, its ERROR stayed the last word on it. The next valid
    reading says the file is valid again, then what was applied (or that there is nothing to). A
    file that is not UTF-8 is an invalid one too, said with where (it was passed over in silence)."""
    path = tmp_path / "gopherplug.yaml"
    path.write_text(config_text(node, **{RESOURCE: {}}))
    both = config_text(node, **{RESOURCE: {}, OTHER: {}})
    with trio.fail_after(TIMEOUT), logged(str(path)) as said:
        await reloading(nursery, node, path)
        for text, line in [
            (b"resources: [", "keeping the running configuration"),
            (both.encode(), "configuration reloaded: "),  # fixed, and different: applied
            (b"resources: [", "keeping the running configuration"),
            (both.encode(), "nothing to apply"),  # fixed, the same as what runs
            (b"resources: [\xff]", "keeping the running configuration"),  # not UTF-8
        ]:
            with logged(line) as done:
                replace_file(path, text)
                await done.wait()
    error = f"{path}: invalid YAML (line 1, column 13: "
    assert [line[: len(error)] if line.startswith(error) else line for line in said.lines] == [
        error,
        f"{path} is valid again: applying it",
        f"{path}: configuration reloaded: added {OTHER}",
        error,
        f"{path} is valid again, the same as the running configuration: nothing to apply",
        f"{path}: invalid YAML at line 1, column 13: byte 0xff is not UTF-8: save the file as UTF-8; "
        "keeping the running configuration",
    ]


def test_a_file_that_is_not_utf8_is_refused_where_its_byte_stands(tmp_path):
    """check-config and the start read the file as a reload does: a byte that is not UTF-8 is one
    line with its place, not the codec's position in bytes."""
    path = tmp_path / "gopherplug.yaml"
    path.write_bytes(b"resources:\n  - name: example.com/g\xe9\n")
    with pytest.raises(gp.ConfigError) as refused:
        gp.load_config(str(path))
    said = "invalid YAML at line 2, column 24: byte 0xe9 is not UTF-8: save the file as UTF-8"
    assert str(refused.value) == f"{path}: {said}"


async def test_reload_that_would_empty_a_served_resource_with_a_warning_is_held_back_until_sighup(
    nursery, node, tmp_path
):
    """A reload that takes a served resource from its devices to none while check-config warns
    about the new file (a regex-looking pattern) is held back like an invalid file: the devices
    stay offered and one line says why and how to apply it anyway (SIGHUP), which then applies it.
    A warned-about file that empties nothing is applied as before."""
    path = tmp_path / "gopherplug.yaml"
    path.write_text(config_text(node, **{RESOURCE: {}}))
    emptying = config_text(node, **{RESOURCE: {"pattern": r"g\d+"}})
    watches = []
    with trio.fail_after(TIMEOUT), logged(str(path)) as said:
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        updates = lambda current: gp.watch_config_file(str(path), current=current, on_watch=watches.append)  # noqa: E731
        await nursery.start(functools.partial(gp.serve_plugin, gp.load_config(str(path)), updates=updates))
        await simulator.wait_until(listed("g1", "g2"))
        with logged("held back") as held:
            replace_file(path, emptying)
            await held.wait()
        await trio.testing.wait_all_tasks_blocked()
        assert streaming(simulator, RESOURCE) == {"g1": gp.HEALTHY, "g2": gp.HEALTHY}
        watches[0].poke()  # what SIGHUP does
        await simulator.wait_until(lambda s: streaming(s, RESOURCE) == {})
        with logged("configuration reloaded") as applied:
            replace_file(path, config_text(node, **{RESOURCE: {"pattern": "g*", "env": "GOPHER_IDS"}}))
            await applied.wait()
        with logged("configuration reloaded") as applied:  # nothing served to empty: applied, with its warning
            replace_file(path, config_text(node, **{RESOURCE: {"pattern": "g*"}, OTHER: {"pattern": r"h\d+"}}))
            await applied.wait()
    warning = r"'g\d+' looks like a regular expression, but pattern is a glob (fnmatch): write 'g[0-9]*'"
    assert said.lines[0] == (
        f"{path}: held back, keeping the running configuration: {RESOURCE} would go from 2 devices to none, and "
        f"resources[0].pattern: {warning}; fix the file, or send the plugin SIGHUP to apply it as it is"
    )


async def test_sighup_on_an_invalid_file_repeats_its_error(tmp_path):
    """Read again on request, an invalid file that did not change says its error again, not
    "unchanged", which would read as all is well."""
    path = tmp_path / "gopherplug.yaml"
    path.write_text(MINIMAL)
    watches = []
    updates = gp.watch_config_file(str(path), current=gp.load_config(str(path)), on_watch=watches.append)
    with trio.fail_after(TIMEOUT), logged(str(path)) as said:
        async with contextlib.aclosing(updates), trio.open_nursery() as nursery:
            nursery.start_soon(updates.__anext__)  # yields nothing here: the file is never valid and new
            with logged("keeping the running configuration") as refused:
                replace_file(path, "resources: [")
                await refused.wait()
            await trio.testing.wait_all_tasks_blocked()  # the watch waits for the next event
            watches[0].poke()  # what SIGHUP does
            await trio.testing.wait_all_tasks_blocked()  # the file has been read again
            nursery.cancel_scope.cancel()
    assert len(said.lines) == 2 and said.lines[0] == said.lines[1], said.lines
    assert said.lines[0].endswith("; keeping the running configuration")


@pytest.mark.slow
async def test_reload_of_our_own_settings_keeps_the_stream_open_and_sends_the_new_list(nursery, node, tmp_path):
    # The kubelet marks every device unhealthy from the end of a stream until the next stream's
    # first list, and rejects the pods it admits then for good: a reload that the kubelet need
    # not hear of (env, replicas, the sources, ...) must keep the stream open.
    path = tmp_path / "gopherplug.yaml"
    path.write_text(config_text(node, **{RESOURCE: {}}))
    specs = [{"host_path": "{path}", "container_path": "/dev/gopher"}]
    reloads = [
        ({"env": "GOPHERS", "replicas": 2}, ("g1::0", "g1::1", "g2::0", "g2::1")),
        ({"env": "GOPHERS", "replicas": 2, "pattern": "g2", "preferred": "spread"}, ("g2::0", "g2::1")),
        ({"env": "AGAIN", "pattern": "g2", "device_specs": specs}, ("g2",)),
    ]
    with trio.fail_after(TIMEOUT):
        simulator = await reloading(nursery, node, path)
        done = trio.Event()

        async def pods_keep_coming():  # each admitted while the reloads are applied
            while not done.is_set():
                ids = [device_id for device_id, health in devices_of(simulator).items() if health == gp.HEALTHY]
                try:
                    await simulator.allocate(RESOURCE, ids[:1])
                except gp.UnexpectedAdmissionError:
                    pass  # counted in simulator.rejections
                except gp.RPCError as error:
                    # An ID of the list from before a change of replicas or pattern, asked for in
                    # the moment before the new list reaches the kubelet: as for a removed device.
                    assert "unknown example.com/gopher device IDs" in error.message

        nursery.start_soon(pods_keep_coming)
        for keys, ids in reloads:
            with logged("configuration reloaded: ") as reloaded:
                replace_file(path, config_text(node, **{RESOURCE: keys}))
                await reloaded.wait()
            await simulator.wait_until(listed(*ids))
            assert reloaded.lines == [f"{path}: configuration reloaded: updated in place {RESOURCE}"]
        done.set()
        answer = (await simulator.allocate(RESOURCE, ["g2"])).container_responses[0]
    assert dict(answer.envs) == {"AGAIN": "g2"}
    assert [(d.host_path, d.container_path) for d in answer.devices] == [(f"{node.devices}/g2", "/dev/gopher")]
    assert simulator.rejections == [], "a pod was admitted while every device was unhealthy"
    assert simulator.events == [("registered", RESOURCE, "gopherplug-example.com_gopher-1.sock")]
    assert node.our_sockets() == ["gopherplug-example.com_gopher-1.sock"]


async def test_reload_that_changes_what_the_kubelet_was_told_registers_again(nursery, node, tmp_path):
    path = tmp_path / "gopherplug.yaml"
    path.write_text(config_text(node, **{RESOURCE: {}}))
    with trio.fail_after(TIMEOUT):
        simulator = await reloading(nursery, node, path)
        with logged("configuration reloaded: ") as reloaded:
            replace_file(path, config_text(node, **{RESOURCE: {"pre_start": ["/bin/true"]}}))  # pre_start_required
            await simulator.wait_until(lambda s: len(s.registrations) == 2 and devices_of(s) == listed_ids("g1", "g2"))
            await reloaded.wait()
    assert reloaded.lines == [f"{path}: configuration reloaded: re-registered {RESOURCE}"]
    assert simulator.resources[RESOURCE].options.pre_start_required
    assert simulator.registrations[1].endpoint == "gopherplug-example.com_gopher-2.sock"
    # The old registration was gone before the new one (the kubelet would drop the new one otherwise).
    assert [event for event, _, _ in simulator.events] == ["registered", "stream ended", "disconnected", "registered"]


async def test_reload_that_registers_again_starts_the_new_watch_before_the_old_registration_stops(
    nursery, node, tmp_path, monkeypatch, caplog
):
    # A change that needs a new registration, which the node refuses for now (the CDI directory
    # cannot be made: a file is in its way), tried again at each step of the backoff: until the
    # refusal ends, the kubelet sees nothing (no new registration, no stream ended, no device lost),
    # then exactly one re-registration.
    monkeypatch.setattr(gp, "SUPERVISE_BACKOFF", (0.001, 0.002))
    path = tmp_path / "gopherplug.yaml"
    path.write_text(config_text(node, **{RESOURCE: {}}))
    (tmp_path / "file").touch()
    spec_dir = tmp_path / "file" / "cdi"
    new = {"pre_start": ["/bin/true"], "cdi": {"kind": "example.com/gopher", "spec_dir": str(spec_dir)}}
    with trio.fail_after(TIMEOUT):
        simulator = await reloading(nursery, node, path)
        with logged(": not applied, tried again") as refused, logged("configuration reloaded: ") as reloaded:
            replace_file(path, config_text(node, **{RESOURCE: new}))
            await refused.wait(4)  # the first try and three more
            assert simulator.events == [("registered", RESOURCE, "gopherplug-example.com_gopher-1.sock")]
            assert devices_of(simulator) == listed_ids("g1", "g2")
            assert not simulator.resources[RESOURCE].options.pre_start_required
            (tmp_path / "file").unlink()
            (tmp_path / "file").mkdir()  # the refusal ends: the next try applies the change
            await simulator.wait_until(lambda s: len(s.registrations) == 2 and devices_of(s) == listed_ids("g1", "g2"))
            await reloaded.wait(len(refused.lines) + 1)
    assert reloaded.lines[-1] == f"{path}: configuration reloaded: re-registered {RESOURCE}"
    assert set(reloaded.lines[:-1]) == {f"{path}: configuration reloaded: kept {RESOURCE} as it was"}
    said = [record.levelno for record in caplog.records if "not applied, tried again" in record.getMessage()]
    assert said == [logging.ERROR] + [logging.DEBUG] * (len(said) - 1), "one line, not one a try"
    assert simulator.resources[RESOURCE].options.pre_start_required
    assert [event for event, _, _ in simulator.events] == ["registered", "stream ended", "disconnected", "registered"]
    assert simulator.registrations[1].endpoint == "gopherplug-example.com_gopher-2.sock"
    assert {device["name"] for device in read_spec(spec_dir / "example.com-gopher.json")["devices"]} == {"g1", "g2"}


@pytest.mark.parametrize(
    ("old", "new", "again"),
    [
        ({"env": "A"}, {"env": "B", "replicas": 3, "preferred": "spread", "pattern": "x*"}, False),
        ({}, {"cdi": {"kind": "example.com/gopher"}}, False),
        ({}, {"mounts": [{"host_path": "{path}", "container_path": "/m"}]}, False),
        ({}, {"pre_start": ["/bin/true"]}, True),
        ({"pre_start": ["/bin/true"]}, {"pre_start": ["/bin/false"], "pre_start_timeout": 3}, False),
        ({}, {"api": "dra"}, True),
    ],
)
def test_register_again_only_when_what_the_kubelet_was_told_changes(node, old, new, again):
    top = {"dra": {"driver": "gopher.example.com"}}
    before = node.config(top=top if "api" in old else (), **old).resources[0]
    after = node.config(top=top if "api" in new else (), **new).resources[0]
    assert gp.register_again(before, after) is again


async def test_removing_a_resource_that_waits_for_the_kubelet_stops_it_at_once(nursery, node, caplog):
    # No kubelet yet: the resource's registration waits for kubelet.sock. Removing it from the
    # configuration must wake that wait, not leave it to the retirement's fallback timer.
    send, receive = trio.open_memory_channel(1)

    async def updates():
        async for config in receive:
            yield config

    with trio.fail_after(TIMEOUT), logged("configuration reloaded: ") as reloaded:
        await nursery.start(functools.partial(gp.serve_plugin, node.config(), updates=lambda _: updates()))
        assert node.our_sockets() == ["gopherplug-example.com_gopher-1.sock"]
        await send.send(gp.parse_config(config_text(node, **{OTHER: {}}), "test.yaml"))
        # Within a moment, not after the 2 s the retirement's fallback would wait.
        with trio.move_on_after(gp.RETIRE_GRACE / 2):
            await reloaded.wait()
    assert reloaded.lines == ["test.yaml: configuration reloaded: added example.com/other, removed example.com/gopher"]
    assert node.our_sockets() == ["gopherplug-example.com_other-1.sock"]


@pytest.mark.slow
async def test_reload_that_cannot_start_a_resource_leaves_the_others_serving(nursery, node, tmp_path, caplog):
    path = tmp_path / "gopherplug.yaml"
    path.write_text(config_text(node, **{RESOURCE: {}}))
    (tmp_path / "file").touch()
    bad_cdi = {"cdi": {"kind": "example.com/other", "spec_dir": str(tmp_path / "file" / "cdi")}}
    with trio.fail_after(TIMEOUT), logged("configuration reloaded: ") as reloaded:
        simulator = await reloading(nursery, node, path)
        replace_file(path, config_text(node, **{RESOURCE: {}, OTHER: bad_cdi}))
        await reloaded.wait()
        assert "example.com/other: cannot write the CDI spec" in caplog.text and ": not applied" in caplog.text
        assert reloaded.lines == [f"{path}: configuration reloaded: did not add example.com/other"]
        replace_file(path, config_text(node, **{RESOURCE: {}, OTHER: {}}))  # fixed: applied
        await simulator.wait_until(lambda s: streaming(s, OTHER) == {"g1": gp.HEALTHY, "g2": gp.HEALTHY})
        assert simulator.resources[RESOURCE].streaming


async def test_reload_that_cannot_be_applied_in_place_keeps_the_running_configuration(nursery, node, tmp_path, caplog):
    path = tmp_path / "gopherplug.yaml"
    path.write_text(config_text(node, **{RESOURCE: {}}))
    (tmp_path / "file").touch()
    bad_cdi = {"env": "NEW", "cdi": {"kind": "example.com/gopher", "spec_dir": str(tmp_path / "file" / "cdi")}}
    with trio.fail_after(TIMEOUT):
        simulator = await reloading(nursery, node, path)
        with logged("configuration reloaded: ") as reloaded:
            replace_file(path, config_text(node, **{RESOURCE: bad_cdi}))
            await reloaded.wait()
        answer = await simulator.allocate(RESOURCE, ["g1"])
        Path(node.devices, "g3").touch()  # still watched
        await simulator.wait_until(listed("g1", "g2", "g3"))
    assert reloaded.lines == [f"{path}: configuration reloaded: kept {RESOURCE} as it was"]
    assert f"{RESOURCE}: cannot write the CDI spec {tmp_path}/file/cdi/example.com-gopher.json: " in caplog.text
    assert dict(answer.container_responses[0].envs) == {"GOPHER_DEVICES": "g1"}, "the old configuration answers"
    assert simulator.events == [("registered", RESOURCE, "gopherplug-example.com_gopher-1.sock")]


async def test_reload_summary_says_a_refused_change_kept_the_resource_as_it_was(nursery, node, tmp_path, caplog):
    path = tmp_path / "gopherplug.yaml"
    path.write_text(config_text(node, **{RESOURCE: {}, OTHER: {}}))
    (tmp_path / "file").touch()
    bad_cdi = {"cdi": {"kind": "example.com/gopher", "spec_dir": str(tmp_path / "file" / "cdi")}}
    with trio.fail_after(TIMEOUT), logged("configuration reloaded: ") as reloaded:
        simulator = await reloading(nursery, node, path)
        replace_file(path, config_text(node, **{RESOURCE: bad_cdi, OTHER: {"env": "OTHERS"}}))
        await reloaded.wait()
        await simulator.wait_until(lambda s: streaming(s, RESOURCE) == {"g1": gp.HEALTHY, "g2": gp.HEALTHY})
    assert "example.com/gopher: cannot write the CDI spec" in caplog.text and ": not applied" in caplog.text
    assert reloaded.lines == [
        f"{path}: configuration reloaded: updated in place example.com/other, kept example.com/gopher as it was"
    ]


async def test_reload_sees_the_target_of_a_symlinked_file_rewritten_and_edits_made_while_starting(node, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "real.yaml").write_text(config_text(node, **{RESOURCE: {}}))
    os.symlink(elsewhere / "real.yaml", tmp_path / "gopherplug.yaml")
    running = gp.load_config(str(tmp_path / "gopherplug.yaml"))
    (elsewhere / "real.yaml").write_text(config_text(node, **{RESOURCE: {"env": "EDITED"}}))  # while starting
    updates = gp.watch_config_file(str(tmp_path / "gopherplug.yaml"), current=running)
    async with contextlib.aclosing(updates):
        with trio.fail_after(TIMEOUT):
            assert (await updates.__anext__()).resources[0].env == "EDITED"
            # In place, as an editor may: IN_CLOSE_WRITE there. A reading between the truncation and
            # the write (an empty file) is refused, and the write's own yields the configuration.
            with open(elsewhere / "real.yaml", "w") as file:
                file.write(config_text(node, **{RESOURCE: {"env": "AGAIN"}}))
            assert (await updates.__anext__()).resources[0].env == "AGAIN"


async def test_reload_follows_rename_and_configmap_symlink_swap(nursery, node, tmp_path):
    # A ConfigMap volume: config.yaml -> ..data/config.yaml, ..data -> ..<timestamp>, swapped by rename.
    volume = tmp_path / "volume"
    (volume / "..v1").mkdir(parents=True)
    (volume / "..v1" / "config.yaml").write_text(config_text(node, **{RESOURCE: {}}))
    os.symlink("..v1", volume / "..data")
    os.symlink("..data/config.yaml", volume / "config.yaml")
    with trio.fail_after(TIMEOUT):
        simulator = await reloading(nursery, node, volume / "config.yaml")
        (volume / "..v2").mkdir()
        (volume / "..v2" / "config.yaml").write_text(config_text(node, **{RESOURCE: {}, OTHER: {}}))
        os.symlink("..v2", volume / "..data_tmp")
        os.rename(volume / "..data_tmp", volume / "..data")
        shutil.rmtree(volume / "..v1")
        await simulator.wait_until(lambda s: streaming(s, OTHER) == {"g1": gp.HEALTHY, "g2": gp.HEALTHY})

        # An editor's save, or mv: a new file renamed over the old name.
        plain = tmp_path / "plain.yaml"
        (tmp_path / "new.yaml").write_text(config_text(node, **{OTHER: {}}))
        os.rename(volume / "..v2" / "config.yaml", plain)  # the old target goes away too
        os.rename(tmp_path / "new.yaml", volume / "..v2" / "config.yaml")
        await simulator.wait_until(lambda s: not s.resources[RESOURCE].streaming)
        await trio.testing.wait_all_tasks_blocked()
    assert node.our_sockets() == ["gopherplug-example.com_other-1.sock"]
