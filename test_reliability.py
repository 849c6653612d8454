"""Scale, reliability and filesystem surprises: the plugin under stress."""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import os
import random
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import h2.config
import h2.connection
import pytest
import trio
import trio.socket
import trio.testing
import yaml

import gopherplug as gp
from gopherplug import StatusCode, v1beta1
from testsupport import (
    HERE,
    RESOURCE,
    TIMEOUT,
    HeldBatches,
    listed,
    listed_ids,
    logged,
    purerpc,
    start,
    without_dac_override,
    write_config,
)

# ------------------------------------------------------------------------------------------------
# Scale: bursts beyond the kernel's inotify queue, lists near the kubelet's message limit
# ------------------------------------------------------------------------------------------------


@pytest.mark.slow
async def test_burst_beyond_the_inotify_queue_ends_in_the_exact_list(nursery, node):
    # More events than the kernel queues (fs.inotify.max_queued_events, 16384 by default) while the
    # plugin cannot read: IN_Q_OVERFLOW, then one rescan. Nothing is lost, and the kubelet gets a
    # handful of messages, not one per event.
    queue_limit = int(Path("/proc/sys/fs/inotify/max_queued_events").read_text())
    count = queue_limit // 2 + 100  # created and deleted: twice that many events
    with trio.fail_after(TIMEOUT * 3):
        simulator = await start(nursery, node)
        updates = simulator.resources[RESOURCE].updates
        for i in range(count):  # no checkpoint in between: the plugin reads nothing meanwhile
            Path(node.devices, f"b{i}").touch()
        for i in range(count):
            os.unlink(os.path.join(node.devices, f"b{i}"))
        Path(node.devices, "last").touch()
        await simulator.wait_until(listed("g1", "g2", "last"))
    assert simulator.resources[RESOURCE].updates - updates <= 3


@pytest.mark.slow
async def test_a_list_over_the_kubelets_message_limit_is_not_sent(nursery, node, caplog):
    # 60 devices x 1000 replicas with 60-character IDs: a 4.5 MiB message, over the 4 MiB limit.
    for name in ("g1", "g2"):
        os.unlink(os.path.join(node.devices, name))
    names = [f"{i:02d}".ljust(60, "x") for i in range(60)]
    for name in names:
        Path(node.devices, name).touch()
    with trio.fail_after(TIMEOUT * 3):
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        await nursery.start(gp.serve_plugin, node.config(replicas=1000))
        await simulator.wait_until(lambda s: RESOURCE in s.resources and s.resources[RESOURCE].streaming)
        await trio.testing.wait_all_tasks_blocked()
        assert simulator.resources[RESOURCE].updates == 0
        assert "60 devices make a 4.5 MiB ListAndWatch message, over the kubelet's limit of 4 MiB: not sent" in (
            caplog.text
        )
        for name in names[50:]:
            os.unlink(os.path.join(node.devices, name))
        await simulator.wait_until(lambda s: len(s.resources[RESOURCE].devices) == 50_000)


# ------------------------------------------------------------------------------------------------
# Reliability: restart storms, deleted sockets, abandoned streams and connections, hostile peers
# ------------------------------------------------------------------------------------------------


@pytest.mark.slow
async def test_100_kubelet_restarts_each_get_a_registration_and_the_right_list(nursery, node):
    await nursery.start(gp.serve_plugin, node.config())
    expected, registrations = ["g1", "g2"], 0
    with trio.fail_after(TIMEOUT * 6):
        for i in range(100):
            async with trio.open_nursery() as kubelet:
                # A new kubelet wipes the directory's sockets and serves kubelet.sock again.
                simulator = await kubelet.start(gp.KubeletSimulator(node.plugin_dir).run)
                await simulator.wait_until(listed(*expected))
                registrations += len(simulator.registrations)
                if i % 2:  # and restarts in place, with a device added meanwhile
                    expected.append(f"r{i}")
                    Path(node.devices, f"r{i}").touch()
                    simulator.restart()
                    await simulator.wait_until(lambda s: s.starts == 2)
                    await simulator.wait_until(listed(*expected))
                    registrations += len(simulator.registrations) - 1
                kubelet.cancel_scope.cancel()
            if i % 10 == 9:  # the kubelet stays away while a device goes
                os.unlink(os.path.join(node.devices, expected.pop()))
    assert registrations == 150
    assert len(node.our_sockets()) == 1


class Incarnations:
    """Which serving of a resource made each socket (serve_resource is wrapped): a resource
    re-registered by a reload, or served by the next plugin, is another incarnation of it."""

    def __init__(self, monkeypatch):
        self.of_endpoint = {}  #: socket file name -> incarnation, for the running plugin
        self.latest = {}  #: resource name -> its latest incarnation
        numbers = itertools.count(1)
        serve = gp.serve_resource

        async def counted(resource, devices, kubelet, shape_allocation=None, generations=None, **kwargs):
            number = self.latest[resource.name] = next(numbers)

            def numbered():
                for n in generations:
                    self.of_endpoint[gp.socket_name(resource.name, kubelet.device_plugin_dir, n)] = number
                    yield n

            await serve(resource, devices, kubelet, shape_allocation, numbered(), **kwargs)

        monkeypatch.setattr(gp, "serve_resource", counted)


STRESS_ROUNDS = 24


STRESS_NAMES = [f"example.com/r{i}" for i in range(4)]


def stress_config(node, resources):
    """resources: name -> (env, pre_start_required); each env given the name's suffix (two resources
    may not share one)."""
    entries = [
        {
            "name": name,
            "directory": node.devices,
            "env": f"{env}_{name[-1]}",
            **({"pre_start": ["/bin/true"]} if pre else {}),
        }
        for name, (env, pre) in sorted(resources.items())
    ]
    document = {"device_plugin_dir": node.plugin_dir, "resources": entries}
    return gp.parse_config(yaml.safe_dump(document), "stress.yaml")


def stress_reload(rng, resources):
    """A reload: resources added, removed, changed in place (env) or re-registered (pre_start)."""
    new = dict(resources)
    for name in STRESS_NAMES:
        roll = rng.random()
        if name not in new:
            if roll < 0.4:
                new[name] = (f"E{rng.randrange(99)}", rng.random() < 0.3)
        elif roll < 0.25 and len(new) > 1:
            del new[name]
        elif roll < 0.5:
            new[name] = (f"E{rng.randrange(99)}", new[name][1])
        elif roll < 0.7:
            new[name] = (new[name][0], not new[name][1])
    return new


def stress_settled(resources, incarnations, first, devices):
    """A predicate: each of ``resources`` registered by its latest incarnation with the kubelet
    running now (registrations from index ``first`` on), streaming ``devices``, healthy."""

    def settled(simulator):
        for name in resources:
            registered = simulator.resources.get(name)
            if registered is None or not registered.streaming or registered.devices != listed_ids(*devices):
                return False
            if incarnations.of_endpoint.get(registered.endpoint) != incarnations.latest[name]:
                return False
            starts = [
                start
                for request, start in zip(simulator.registrations[first:], simulator.registered_in[first:], strict=True)
                if request.endpoint == registered.endpoint
            ]
            if starts[-1:] != [simulator.starts]:
                return False
        return not simulator.restarting

    return settled


def merged(rng, *scripts):
    """The steps of ``scripts`` in one random order that keeps each script's own order."""
    scripts = [list(script) for script in scripts if script]
    steps = []
    while scripts:
        script = rng.choices(scripts, [len(script) for script in scripts])[0]
        steps.append(script.pop(0))
        scripts = [script for script in scripts if script]
    return steps


async def stress_round(rng, simulator, node, incarnations, held, reloaded):
    """One round of the stress test below: its actions, and (kubelet start, incarnation) for each
    registration made in it."""
    resources = {name: ("E", False) for name in rng.sample(STRESS_NAMES, rng.randint(1, 3))}
    send, receive = trio.open_memory_channel(8)
    reloads, holds, first, reloaded_before = 0, [], len(simulator.registrations), len(reloaded.lines)
    incarnations.of_endpoint.clear()

    async def updates():
        async for config in receive:
            yield config

    plugin_steps = ["start", *["reload"] * rng.randint(0, 2), *["device"] * rng.randint(2, 4)]
    rng.shuffle(plugin_steps)
    kubelet_steps = []
    for _ in range(rng.randint(1, 2)):
        kubelet_steps += rng.choice([["restart"], ["remove directory"], ["hold", "release"]])
    slow = rng.random() < 0.75  # the reader is behind from the start
    reader_steps = rng.choice([[], ["catch up"]] if slow else [[], ["slow inotify"], ["slow inotify", "catch up"]])
    actions = (["slow inotify"] if slow else []) + merged(rng, plugin_steps, kubelet_steps, reader_steps)
    async with trio.open_nursery() as plugin:
        for action in actions:
            pause = rng.choice(["none", "switches", "quiet"])
            if pause == "switches":
                for _ in range(rng.randint(1, 30)):
                    await trio.lowlevel.checkpoint()
            elif pause == "quiet":
                await trio.testing.wait_all_tasks_blocked()
            if action == "start":
                plugin.start_soon(
                    functools.partial(gp.serve_plugin, stress_config(node, resources), updates=lambda _: updates())
                )
            elif action == "restart":
                simulator.restart()
            elif action == "hold":  # the sockets wiped, kubelet.sock made only at "release" (or at the end)
                holds.append(trio.Event())
                simulator.restart(hold=holds[-1])
            elif action == "release":  # that kubelet listens at last
                holds.pop(0).set()
            elif action == "remove directory":
                simulator.restart(remove_directory=True)
            elif action == "reload":
                resources = stress_reload(rng, resources)
                send.send_nowait(stress_config(node, resources))
                reloads += 1
            elif action == "slow inotify":  # the plugin's reader of the kubelet's directory falls behind,
                held.close()  # once it has read the kubelet's checkpoint, written anew
                with contextlib.suppress(FileNotFoundError):  # (the directory removed meanwhile)
                    Path(node.plugin_dir, "checkpoint.tmp").touch()
                    os.rename(
                        Path(node.plugin_dir, "checkpoint.tmp"), Path(node.plugin_dir, "kubelet_internal_checkpoint")
                    )
            elif action == "catch up":
                held.open()
            elif action == "device":  # a device comes or goes, which wakes a registration waiting, too
                device = Path(node.devices, "g3")
                if device.exists():
                    device.unlink()
                else:
                    device.touch()
        for hold in holds:
            hold.set()
        held.open()
        await reloaded.wait_for_lines(reloaded_before + reloads)  # every reload applied
        await simulator.wait_until(stress_settled(resources, incarnations, first, sorted(os.listdir(node.devices))))
        for name in resources:
            with contextlib.suppress(gp.UnexpectedAdmissionError):  # recorded in simulator.rejections
                await simulator.allocate(name, ["g1"])
        made = [
            (start, incarnations.of_endpoint[request.endpoint])
            for request, start in zip(simulator.registrations[first:], simulator.registered_in[first:], strict=True)
        ]
        plugin.cancel_scope.cancel()
    return actions, made


@pytest.mark.slow
async def test_kubelet_restarts_interleaved_with_starts_and_reloads_register_once_per_kubelet(
    nursery, node, monkeypatch
):
    # As a stress test: in each round a plugin starts, the kubelet restarts (at
    # once; or wiping our sockets, then listening only later; or with its directory removed), the
    # configuration is reloaded (resources added, removed, changed in place, re-registered), a
    # device comes or goes, and the plugin's inotify reader falls behind and catches up: in a
    # random order, with random pauses (task switches, or until everything waits), seeded. Once it
    # has settled, each configured resource must be registered with the kubelet running then,
    # streaming its devices healthy, and a pod must get one; and no kubelet may ever have had two
    # registrations from one serving of a resource.
    incarnations = Incarnations(monkeypatch)
    held = HeldBatches(monkeypatch, node.plugin_dir)
    simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
    seen = collections.Counter()  # (kubelet start, incarnation) -> registrations
    with trio.fail_after(TIMEOUT * 6), logged("configuration reloaded") as reloaded:
        for round_ in range(STRESS_ROUNDS):
            rng = random.Random(round_)
            actions, made = await stress_round(rng, simulator, node, incarnations, held, reloaded)
            seen.update(made)
            twice = {key: count for key, count in seen.items() if count > 1}
            assert not twice, f"round {round_} ({', '.join(actions)}): one serving registered twice: {twice}"
            assert not simulator.rejections, f"round {round_} ({', '.join(actions)}): {simulator.rejections}"
    assert simulator.starts > STRESS_ROUNDS


@pytest.mark.slow
async def test_our_socket_deleted_100_times_never_two_servers(nursery, node):
    with trio.fail_after(TIMEOUT * 6):
        simulator = await start(nursery, node)
        for i in range(100):
            [ours] = node.our_sockets()  # one server for the resource, always
            os.unlink(os.path.join(node.plugin_dir, ours))
            await simulator.wait_until(lambda s, n=i + 2: len(s.registrations) == n and s.resources[RESOURCE].streaming)
            await simulator.wait_until(listed("g1", "g2"))
    assert node.our_sockets() == ["gopherplug-example.com_gopher-101.sock"]


def open_fds():
    return len(os.listdir("/proc/self/fd"))


def rss_kib():
    return int(next(line for line in Path("/proc/self/status").read_text().splitlines() if "VmRSS" in line).split()[1])


def half_request(path):
    """The bytes of a client preface and the first half of an Allocate call: headers, no end."""
    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    connection.initiate_connection()
    headers = [
        (":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "localhost"),
        ("te", "trailers"), ("content-type", "application/grpc"),
    ]  # fmt: skip
    connection.send_headers(1, headers)
    return connection.data_to_send()


@pytest.mark.slow
async def test_1000_abandoned_streams_and_connections_leave_nothing_behind(nursery, node):
    with trio.fail_after(TIMEOUT * 6):
        simulator = await start(nursery, node)
        endpoint = os.path.join(node.plugin_dir, simulator.registrations[0].endpoint)
        method = gp.METHODS["/v1beta1.DevicePlugin/ListAndWatch"]
        request = half_request("/v1beta1.DevicePlugin/Allocate")

        async def cycle(i):
            if i % 2:  # a ListAndWatch stream opened, its first list read, then cancelled
                async with gp.open_stream(endpoint, method, v1beta1.Empty(), timeout=TIMEOUT) as responses:
                    async for _ in responses:
                        break
            else:  # a connection dropped in the middle of a call
                sock = trio.socket.socket(trio.socket.AF_UNIX)
                await sock.connect(endpoint)
                await sock.send(request)
                sock.close()

        for i in range(100):  # warm up: caches, allocator arenas
            await cycle(i)
        await trio.testing.wait_all_tasks_blocked()
        fds, rss = open_fds(), rss_kib()
        for i in range(1000):
            await cycle(i)
        await trio.testing.wait_all_tasks_blocked()  # the plugin has seen every goodbye
        assert open_fds() == fds
        assert rss_kib() - rss < 4096, "a generous bound: leaking 1 KiB per cycle would cross it"
        assert simulator.resources[RESOURCE].streaming, "the kubelet's own stream was served throughout"
        Path(node.devices, "g3").touch()
        await simulator.wait_until(listed("g1", "g2", "g3"))


def h2_frame(kind, flags, stream_id, payload):
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream_id.to_bytes(4, "big") + payload


PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


HOSTILE = {
    "random bytes": random.Random(7).randbytes(4096),
    "a truncated preface": PREFACE[:10],
    "a preface and garbage": PREFACE + h2_frame(4, 0, 0, b"") + b"\xff" * 100,
    "a huge header block": PREFACE
    + h2_frame(4, 0, 0, b"")
    + h2_frame(1, 0x4, 1, b"\x00\x0aabcdefghij" + b"\x7f" * 16000)
    + b"".join(h2_frame(9, 0, 1, b"\x00" * 16000) for _ in range(200)),
    "a message over the limit": half_request("/v1beta1.DevicePlugin/Allocate")
    + h2_frame(0, 0, 1, b"\x00" + (64 * 1024 * 1024).to_bytes(4, "big") + b"\x00" * 1000),
}


async def grpc_status_of_stream_1(sock):
    """grpc-status of the first HEADERS frame on stream 1 that carries one, read from raw frames."""
    import hpack

    decoder, data = hpack.Decoder(), b""
    while True:
        chunk = await sock.recv(65536)
        assert chunk, "the connection was closed"
        data += chunk
        while len(data) >= 9 and len(data) >= 9 + int.from_bytes(data[:3], "big"):
            length, kind, stream_id = int.from_bytes(data[:3], "big"), data[3], int.from_bytes(data[5:9], "big")
            payload, data = data[9 : 9 + length], data[9 + length :]
            if kind == 1:  # HEADERS (h2 sends them without padding or priority)
                headers = dict(decoder.decode(payload))
                if stream_id == 1 and "grpc-status" in headers:
                    return headers["grpc-status"]


@pytest.mark.slow
@pytest.mark.parametrize("what", list(HOSTILE))
async def test_hostile_bytes_get_the_connection_closed_and_the_kubelet_served(nursery, node, what, monkeypatch):
    monkeypatch.setattr(gp, "HANDSHAKE_TIMEOUT", 0.5)  # for the truncated preface: 10 s in production
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node)
        endpoint = os.path.join(node.plugin_dir, simulator.registrations[0].endpoint)
        sock = trio.socket.socket(trio.socket.AF_UNIX)
        await sock.connect(endpoint)
        try:
            await sock.send(HOSTILE[what])
        except OSError:
            pass  # closed on us while we were still sending: the point
        if what == "a message over the limit":
            # That call is refused as grpc-go refuses it (RESOURCE_EXHAUSTED), the connection kept
            #: the answer's HEADERS on stream 1, decoded by hand.
            assert await grpc_status_of_stream_1(sock) == "8"  # RESOURCE_EXHAUSTED
        else:
            try:
                while await sock.recv(65536):  # whatever it answers (a GOAWAY), then end of file
                    pass
            except ConnectionResetError:
                pass  # closed with our bytes still unread: closed all the same
        sock.close()
        Path(node.devices, "g3").touch()
        await simulator.wait_until(listed("g1", "g2", "g3"))
        assert simulator.resources[RESOURCE].streaming


@pytest.mark.slow
@pytest.mark.parametrize(
    ("ids", "code"),
    [
        ([], None),
        ([""], StatusCode.INVALID_ARGUMENT),
        (["g1", "g1", "g1"], None),
        ([f"x{i}" for i in range(5000)], StatusCode.INVALID_ARGUMENT),
        (["g1", "\x00\xff" * 100], StatusCode.INVALID_ARGUMENT),
        (["g1", "g²"], StatusCode.INVALID_ARGUMENT),  # found by hypothesis: a digit int() cannot read
    ],
)
async def test_absurd_requests_get_clean_answers(nursery, node, ids, code):
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node)
        endpoint = os.path.join(node.plugin_dir, simulator.registrations[0].endpoint)
        calls = {
            "Allocate": v1beta1.AllocateRequest(container_requests=[v1beta1.ContainerAllocateRequest(devices_ids=ids)]),
            "PreStartContainer": v1beta1.PreStartContainerRequest(devices_ids=ids),
            "GetPreferredAllocation": v1beta1.PreferredAllocationRequest(
                container_requests=[
                    v1beta1.ContainerPreferredAllocationRequest(
                        available_deviceIDs=ids, must_include_deviceIDs=ids[::-1], allocation_size=2**31 - 1
                    )
                ]
            ),
            "GetDevicePluginOptions": v1beta1.Empty(),
        }
        for name, request in calls.items():
            method = gp.METHODS[f"/v1beta1.DevicePlugin/{name}"]
            try:
                answer = await gp.call_unary(endpoint, method, request, timeout=TIMEOUT)
            except gp.RPCError as error:
                assert name == "Allocate" and error.code == code, error
                assert error.message.startswith("unknown example.com/gopher device IDs: ")
                continue
            if name == "Allocate":
                assert code is None
                assert answer.container_responses[0].envs["GOPHER_DEVICES"] == ",".join(dict.fromkeys(ids))
            if name == "GetPreferredAllocation":
                assert set(answer.container_responses[0].deviceIDs) <= set(ids)
        assert simulator.resources[RESOURCE].streaming


@pytest.mark.slow
@pytest.mark.parametrize("behaviour", ["hangs in Register", "never dials back", "drops the stream at once"])
async def test_a_misbehaving_kubelet_then_a_good_one(nursery, node, monkeypatch, caplog, behaviour):
    monkeypatch.setattr(gp, "REGISTER_TIMEOUT", 0.3)  # 15 s in production
    calls = gp.Watched(0)

    async def register(request):
        calls.set(calls.value + 1)
        if behaviour == "hangs in Register":
            await trio.sleep_forever()
        if behaviour == "drops the stream at once":
            endpoint = os.path.join(node.plugin_dir, request.endpoint)
            method = gp.METHODS["/v1beta1.DevicePlugin/ListAndWatch"]
            async with gp.open_stream(endpoint, method, v1beta1.Empty(), timeout=TIMEOUT) as responses:
                async for _ in responses:
                    break
        return v1beta1.Empty()

    service = purerpc.Service("v1beta1.Registration")
    service.add_method("Register", register, gp.METHODS[gp.REGISTER].signature)
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as bad:
            await bad.start(gp.serve_grpc, os.path.join(node.plugin_dir, gp.KUBELET_SOCKET), [service])
            await nursery.start(gp.serve_plugin, node.config())
            while calls.value < (2 if behaviour == "hangs in Register" else 1):  # a hung one is retried
                await calls.wait_touched()
            bad.cancel_scope.cancel()
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)  # a good kubelet starts
        await simulator.wait_until(listed("g1", "g2"))
    if behaviour == "hangs in Register":
        assert "registration failed, retrying in 0.01 s: DEADLINE_EXCEEDED" in caplog.text


# Filesystem surprises


async def test_device_directory_replaced_by_a_file_and_back(nursery, node):
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node)
        shutil.rmtree(node.devices)
        Path(node.devices).write_text("not a directory")
        await simulator.wait_until(listed())
        os.unlink(node.devices)
        os.mkdir(node.devices)
        Path(node.devices, "g9").touch()
        await simulator.wait_until(listed("g9"))


async def test_odd_names_are_skipped_with_a_warning(nursery, node, caplog):
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node)
        for name in [b"new\nline", b"bad\xffbyte", b"tab\there", b"-x" * 40]:
            os.close(os.open(os.path.join(os.fsencode(node.devices), name), os.O_CREAT | os.O_WRONLY))
        Path(node.devices, "g3").touch()
        await simulator.wait_until(listed("g1", "g2", "g3"))
    for shown in ["'new\\nline'", "'bad\\udcffbyte'", "'tab\\there'", repr("-x" * 40)]:
        assert f"skipping {shown}: a device ID must be 1 to 63 of A-Z a-z 0-9 . _ - :, without '::'" in caplog.text


@pytest.mark.slow
async def test_device_directory_on_its_own_mount(nursery, node):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "gopherplug-test", node.devices], capture_output=True, check=False
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        with trio.fail_after(TIMEOUT):
            simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
            await nursery.start(gp.serve_plugin, node.config())
            await simulator.wait_until(listed())  # the mount hides g1 and g2
            Path(node.devices, "m1").touch()
            await simulator.wait_until(listed("m1"))
            subprocess.run(["umount", node.devices], check=True)  # inotify: IN_UNMOUNT, the watch is gone
            await simulator.wait_until(listed("g1", "g2"))
            Path(node.devices, "g3").touch()  # watched again
            await simulator.wait_until(listed("g1", "g2", "g3"))
    finally:
        subprocess.run(["umount", node.devices], capture_output=True, check=False)


@pytest.mark.slow
async def test_unreadable_device_directory_has_no_devices_until_readable(nursery, node, tmp_path):
    path = write_config(node, tmp_path)
    simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
    process = await trio.lowlevel.open_process(
        [*without_dac_override(), sys.executable, str(HERE / "gopherplug.py"), "--config", str(path)],
        stderr=subprocess.DEVNULL,
    )
    try:
        with trio.fail_after(TIMEOUT):
            await simulator.wait_until(listed("g1", "g2"))
            os.chmod(node.devices, 0)
            await simulator.wait_until(listed())
            os.chmod(node.devices, 0o755)
            await simulator.wait_until(listed("g1", "g2"))
    finally:
        os.chmod(node.devices, 0o755)
        process.terminate()
        await process.wait()


async def test_the_search_for_a_programs_daemons_runs_off_the_event_loop_within_a_deadline(monkeypatch):
    """Once a program ends, /proc/*/environ is read for its mark: thousands of processes on a busy host,
    and the environ of one in uninterruptible sleep may never be read. A worker thread does it, given
    up after FILE_READ_TIMEOUT: the program's answer does not wait for it, the event loop never does."""
    monkeypatch.setattr(gp, "FILE_READ_TIMEOUT", 0.2)
    entered, release, came_back = threading.Event(), threading.Event(), threading.Event()

    def hung_open(path, *args, **kwargs):  # the first environ read hangs, as in the D state
        if str(path).endswith("/environ") and not entered.is_set():
            entered.set()
            release.wait(TIMEOUT)
            came_back.set()
        return open(path, *args, **kwargs)

    monkeypatch.setattr(gp, "open", hung_open, raising=False)
    with trio.fail_after(TIMEOUT):
        ran = await gp.run_program(["true"], os.environ)
        assert ran.returncode == 0 and entered.is_set()
        assert not came_back.is_set(), "answered while the read still hung"
        release.set()
        await trio.to_thread.run_sync(came_back.wait, TIMEOUT)  # the thread left to itself ends
