"""Every parser gopherplug has, proven by properties over generated inputs (hypothesis).

Each parser takes what someone else wrote: the configuration file, a capacity or attribute file,
the output of `describe`, a kubelet's or a peer's request. The rule at that boundary is that an input
costs a refusal (one line) and never the process. The properties here say so for every parser, and
say what each one keeps: a quantity's value, a name as Go's rules count it, a label NFD accepts.

In CI (CI=true) the examples are derandomized, with a fixed budget: the same inputs on every run, so
that a submission lands or not on its own merits. Locally they vary; HYPOTHESIS_EXAMPLES=5000 searches
harder, and bench/fuzz.py runs every property here for as long as it is asked to, counting the inputs
it tried and the ones that raised.

The properties take no pytest fixtures: bench/fuzz.py calls them as they are.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import logging
import os
import pathlib
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable
from typing import Any

import trio
import trio.testing
import yaml
from hypothesis import HealthCheck, Phase, assume, example, given, settings
from hypothesis import strategies as st

import gopherplug as gp

PROPERTIES = settings(
    max_examples=int(os.environ.get("HYPOTHESIS_EXAMPLES", "300")),
    deadline=None,
    derandomize=bool(os.environ.get("CI")),
    suppress_health_check=[HealthCheck.too_slow],
)


# Quantities; attribute and capacity names and values; CDI names (issue 44, helper "rules")


# NFD label names and values; HTTP request heads (issue 44, helper "boundary")


# Configuration documents; describe output (issue 44, helper "fuzz")
#
# The seeds are every configuration the repository ships. A document is a seed mutated as a person
# or a broken tool would: in its YAML data (a key removed, renamed or added, a value replaced by one
# of another type, a boundary number, an odd string) or in its text (bytes flipped, cut short, a line
# doubled, an indentation changed); or one put together from the seeds' keys and values alone. The
# rule: parse_config gives a Config or raises ConfigError, one line that begins with the file's
# name; nothing else ever leaves it (a reload catches ConfigError only: anything else ends the
# plugin on every node the ConfigMap reaches).
#
# describe's output is bytes from a program: JSON of any shape, or nearly JSON. parse_description
# refuses with ValueError (run_describe turns it into DescribeError), and what it keeps becomes
# device values through with_read_values, then a ResourceSlice's device and NFD labels: none of
# these may raise.

HERE = pathlib.Path(__file__).resolve().parent


def shipped_configurations() -> list[tuple[str, str]]:
    """(file name, YAML text) of every configuration the repository ships: config.example.yaml, the
    examples', and the `config` of the chart's CI values, with the dra key the chart's ConfigMap
    adds in DRA mode (templates/configmap.yaml)."""
    files = [HERE / "config.example.yaml", *sorted(HERE.glob("examples/*/config*.yaml"))]
    seeds = [(str(path.relative_to(HERE)), path.read_text()) for path in files]
    for path in sorted(HERE.glob("chart/gopherplug/ci/*-values.yaml")):
        values = yaml.safe_load(path.read_text())
        if isinstance(values.get("config"), dict):
            config = dict(values["config"])
            if values.get("mode") == "dra":
                config["dra"] = {"driver": (values.get("dra") or {}).get("driver", "gopherplug.example.com")}
            seeds.append((f"{path.relative_to(HERE)}:config", yaml.safe_dump(config)))
    return seeds


SEEDS = shipped_configurations()
SEED_DATA = [(name, yaml.safe_load(text)) for name, text in SEEDS]


def _harvest(data: Any, keys: set[str], values: dict[str, list[Any]]) -> None:
    """Every key of ``data`` into ``keys``, and each key's values into ``values``."""
    if isinstance(data, dict):
        for key, value in data.items():
            keys.add(key)
            values.setdefault(key, []).append(value)
            _harvest(value, keys, values)
    elif isinstance(data, list):
        for item in data:
            _harvest(item, keys, values)


_SEED_KEYS: set[str] = set(gp._RESOURCE_KEYS)
_SEED_VALUES: dict[str, list[Any]] = {}
for _, _data in SEED_DATA:
    _harvest(_data, _SEED_KEYS, _SEED_VALUES)
KEYS = tuple(sorted(_SEED_KEYS))

#: Values at the edges: of types, of numbers (int32, int64, past them), of YAML 1.1 (octal,
#: booleans), of quantities (the exa suffix, an exponent no decimal context holds), of templates and
#: paths, and strings a log line or a file name would choke on.
ODD_VALUES: tuple[Any, ...] = (
    None, True, False, 0, 1, -1, 7, 2**31 - 1, 2**31, 2**63 - 1, 2**63, -(2**63) - 1, 10**30, 0.5, -0.0,
    1e308, float("inf"), float("nan"), "", " ", "0", "010", "0x1F", "1e9999999", "2E", "16Ei", "1.5Gi",
    "-1", "*", "**", "/", "//", "/dev", "/dev/", "/dev/../etc", "relative/path", "~", "a" * 300, "\x00",
    "\t", "\n", "\u2028", "\ud800", "é", "{id}", "{", "}", "{0}", "{id!r}", "{id.real}", "{sysfs}",
    "{index}", "%s", "example.com/gopher", "example.com/", "EXAMPLE.com/x", "a/b/c", "true", "null",
    "[", "&a", "*a", "dra", "device-plugin", "NoExecute", [], {}, [None], {"version": "1.2.3"},
    {"file": "/x/{id}"}, {"file": "{nope}"},
)  # fmt: skip

_odd = st.sampled_from(ODD_VALUES)
_scalars = st.one_of(
    _odd,
    _odd,
    _odd,
    st.text(max_size=12),
    st.integers(),
    st.floats(),
    st.sampled_from(KEYS).flatmap(lambda key: st.sampled_from(_SEED_VALUES.get(key) or [None])),
)
#: A value of any YAML shape, mostly small: a copy, which a mutation may change (sampled_from gives
#: the very object of ODD_VALUES or of a seed).
values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
).map(copy.deepcopy)


def _slots(data: Any) -> list[tuple[Any, Any]]:
    """Every (container, key or index) in ``data``, the containers' own included."""
    slots, stack = [], [data]
    while stack:
        item = stack.pop()
        pairs = item.items() if isinstance(item, dict) else enumerate(item) if isinstance(item, list) else ()
        for key, value in pairs:
            slots.append((item, key))
            stack.append(value)
    return slots


@st.composite
def mutated_data(draw: st.DrawFn, data: Any) -> Any:
    """``data`` changed one to four times: a value replaced, a key or item removed, a key added or
    renamed, a value wrapped in a list or a mapping, an item doubled."""
    data = copy.deepcopy(data)
    for _ in range(draw(st.integers(1, 4))):
        slots = _slots(data)
        if not slots:
            return draw(values)
        container, key = slots[draw(st.integers(0, len(slots) - 1))]
        how = draw(st.sampled_from(("replace", "replace", "delete", "insert", "rename", "wrap", "double")))
        if how == "replace":
            container[key] = draw(values)
        elif how == "delete":
            del container[key]
        elif how == "insert" and isinstance(container, dict):
            container[draw(st.sampled_from(KEYS) | st.text(max_size=6))] = draw(values)
        elif how == "insert":
            container.insert(draw(st.integers(0, len(container))), draw(values))
        elif how == "rename" and isinstance(container, dict):
            container[draw(st.sampled_from(KEYS))] = container.pop(key)
        elif how == "wrap":
            container[key] = draw(st.sampled_from([[container[key]], {draw(st.sampled_from(KEYS)): container[key]}]))
        elif isinstance(container, list):  # double: the same item twice (a resource named twice)
            container.append(copy.deepcopy(container[key]))
    return data


_STYLES = st.sampled_from([False, None, True])


def _dump(draw: st.DrawFn, data: Any) -> str:
    style = {"default_flow_style": draw(_STYLES), "allow_unicode": draw(st.booleans()), "sort_keys": False}
    try:
        return yaml.dump(data, Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper), **style)  # libyaml's: faster
    except UnicodeEncodeError:  # a lone surrogate, which only PyYAML's own dumper writes (escaped)
        return yaml.safe_dump(data, **style)


#: Pieces of YAML syntax a text mutation puts in: indicators, anchors, tags, documents, odd breaks.
_SYNTAX = [":", ": ", "- ", "\t", "'", '"', "{", "}", "[", "]", ",", "#", "&a ", "*a", "!!binary ", "!!int ",
           "!!python/object:os.system ", "? ", "|", ">", "%YAML 1.1\n", "---\n", "...\n", "\ufeff", "\r",
           "\x85", "\u2028", "\x00", "<<: *a\n", "0o17", "1e9999999", "2E"]  # fmt: skip


@st.composite
def mutated_text(draw: st.DrawFn, text: str) -> str:
    """``text`` changed one to three times as bytes or lines: a byte flipped or replaced (decoded as
    UTF-8 with replacement), cut short, a line doubled, dropped or moved, indented differently, a piece
    of YAML syntax put in."""
    for _ in range(draw(st.integers(1, 3))):
        lines = text.split("\n")
        line = draw(st.integers(0, len(lines) - 1))
        how = draw(st.sampled_from(("byte", "cut", "double", "drop", "swap", "indent", "syntax")))
        if how == "byte" and text:
            raw = bytearray(text.encode(errors="surrogatepass"))
            at = draw(st.integers(0, len(raw) - 1))
            raw[at] = draw(st.sampled_from([raw[at] ^ (1 << draw(st.integers(0, 7))), draw(st.integers(0, 255))]))
            text = raw.decode(errors="replace")
            continue
        if how == "cut":
            text = text[: draw(st.integers(0, len(text)))]
            continue
        if how == "double":
            lines.insert(line, lines[line])
        elif how == "drop":
            del lines[line]
        elif how == "swap":
            lines.insert(draw(st.integers(0, len(lines) - 1)), lines.pop(line))
        elif how == "indent":
            lines[line] = " " * draw(st.integers(0, 9)) + lines[line].lstrip(" ")
        else:
            column = draw(st.integers(0, len(lines[line])))
            piece = draw(st.sampled_from(_SYNTAX) | st.text(max_size=4))
            lines[line] = lines[line][:column] + piece + lines[line][column:]
        text = "\n".join(lines)
    return text


@st.composite
def mutations_of(draw: st.DrawFn, text: str, data: Any) -> str:
    """A configuration's ``text`` (``data`` as YAML reads it) mutated in its data, its text, or both."""
    how = draw(st.sampled_from(("data", "text", "both")))
    if how != "text":
        text = _dump(draw, draw(mutated_data(data)))
    if how != "data":
        text = draw(mutated_text(text))
    return text


@st.composite
def mutated_configurations(draw: st.DrawFn) -> tuple[str, str]:
    """(file name, text): a shipped configuration mutated."""
    index = draw(st.integers(0, len(SEEDS) - 1))
    return SEEDS[index][0], draw(mutations_of(SEEDS[index][1], SEED_DATA[index][1]))


#: For each key, the values the seeds give it, or one of any shape.
_VALUES_OF = {key: st.sampled_from(_SEED_VALUES.get(key) or [None]).map(copy.deepcopy) | values for key in KEYS}


@st.composite
def generated_configurations(draw: st.DrawFn) -> tuple[str, str]:
    """(file name, text): a document of the seeds' keys, each with a value the seeds give that key
    or one of any shape."""

    def entry() -> dict[str, Any]:
        return {key: draw(_VALUES_OF[key]) for key in draw(st.lists(st.sampled_from(KEYS), max_size=6, unique=True))}

    top = entry()
    if draw(st.booleans()):
        top["resources"] = [entry() for _ in range(draw(st.integers(0, 3)))]
    return draw(st.sampled_from(("gopherplug.yaml", "a b:c.yaml", ""))), _dump(draw, top)


def assert_config_or_one_line(text: str, source: str) -> None:
    """parse_config(text) is a Config, or ConfigError: one line that begins with ``source``."""
    try:
        config = gp.parse_config(text, source)
    except gp.ConfigError as error:
        line = str(error)
        assert line.startswith(f"{source}: ") and len(line.splitlines()) == 1, line
    else:
        assert isinstance(config, gp.Config)
        assert all(len(warning.splitlines()) == 1 for warning in config.warnings), config.warnings


#: Documents the properties found that raised something else: tried on every run, and by check-config.
FOUND = [
    "resources:\n- name: \x1f",  # PyYAML's ReaderError: two lines, no mark
    "resources: !!int x",  # PyYAML's constructors raise ValueError, KeyError, AttributeError
    "resources: !!bool x",
    "resources: !!timestamp x",
    "resources: 2020-02-30",  # an implicit timestamp, too
    "resources: " + "[" * 5000,  # RecursionError in PyYAML's composer
    # issue 44's H1 (canonical_quantity): fixed on branch "rules"
    "resources: [{name: example.com/g, directory: /dev/g, capacity: {memory: 2E}}]",
    "resources: [{name: example.com/g, directory: /dev/g, capacity: {memory: 1e9999999}}]",
]


@PROPERTIES
@given(mutated_configurations())
def test_a_mutated_shipped_configuration_is_a_config_or_one_line(document: tuple[str, str]) -> None:
    assert_config_or_one_line(document[1], document[0])


for _text in FOUND:
    test_a_mutated_shipped_configuration_is_a_config_or_one_line = example(("found.yaml", _text))(
        test_a_mutated_shipped_configuration_is_a_config_or_one_line
    )


def test_check_config_says_one_line_and_no_traceback(tmp_path: pathlib.Path) -> None:
    """`gopherplug check-config` on what the properties found, and on a file that is no UTF-8: exit 2
    (invalid) and one line on stderr, never a traceback."""
    texts = [text.encode(errors="surrogatepass") for text in FOUND] + [b"resources: [\xff\xfe]"]
    for number, text in enumerate(texts):
        path = tmp_path / f"found-{number}.yaml"
        path.write_bytes(text)
        command = [sys.executable, str(HERE / "gopherplug.py"), "check-config", "--config", str(path)]
        result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
        said = result.stderr.strip()
        assert result.returncode == 2 and "Traceback" not in said and len(said.splitlines()) == 1, (text, said)
        assert said.startswith(f"gopherplug: {path}: "), said


@PROPERTIES
@given(generated_configurations())
def test_a_configuration_of_any_keys_and_values_is_a_config_or_one_line(document: tuple[str, str]) -> None:
    assert_config_or_one_line(document[1], document[0])


#: A DRA resource with describe, a literal attribute and capacity of its own (which a described value
#: of the same name must not replace), and NFD labels: every path a described value takes.
DESCRIBED = gp.parse_config(
    f"""
dra: {{driver: gopherplug.example.com}}
resources:
  - name: example.com/gpu
    directory: /dev/dri
    api: dra
    replicas: 2
    attributes: {{model: H200, example.com/rack: 7}}
    capacity: {{memory: 80Gi}}
    describe: [{json.dumps(sys.executable)}, -c, pass]
""",
    "described.yaml",
).resources[0]

_attribute_names = st.sampled_from(
    ["model", "driverVersion", "memory", "healthy", "id", "resource", "numaNode", "example.com/rack",
     "gopherplug.example.com/healthy", "resource.kubernetes.io/pcieRoot", "a" * 33, "x/y/z", "", "1st", "é"]
) | st.text(max_size=10)  # fmt: skip
_surrogates = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
_odd_strings = st.sampled_from(["580.159.4", "1.2.3-rc.1+b", "01.2.3", "1.2", "80Gi", "2E", "16Ei", "1e9999999",
                                "-1", "0x10", "\n", "\u2028", "é" * 40, "x" * 65])  # fmt: skip
_odd_strings |= st.text(max_size=8) | _surrogates
_json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers() | st.sampled_from([2**63 - 1, 2**63, -(2**63) - 1, 10**30]),
    st.floats(),  # with NaN and infinities, which json writes and reads
    _odd_strings,
)
#: JSON of any shape, small.
json_values = st.recursive(
    _json_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_odd_strings, inner, max_size=3),
    max_leaves=8,
)
_attribute_values = _json_scalars | st.dictionaries(
    st.sampled_from([*gp.ATTRIBUTE_TYPES, "quantity", "file"]), _json_scalars | json_values, min_size=1, max_size=2
)
_capacity_values = _json_scalars | json_values
_device_ids = st.sampled_from(["card0", "card1", "g1", "", "a" * 70, "x::1"]) | _odd_strings


_described_device = st.fixed_dictionaries(
    {},
    optional={
        "attributes": st.dictionaries(_attribute_names, _attribute_values, max_size=5) | json_values,
        "capacity": st.dictionaries(_attribute_names, _capacity_values, max_size=3) | json_values,
        "extra": json_values,
    },
)
#: What a describe program means to print: device IDs to their attributes and capacity, any part
#: of it of another shape or type.
descriptions = st.dictionaries(_device_ids, _described_device | json_values, max_size=3) | json_values


@st.composite
def describe_outputs(draw: st.DrawFn) -> bytes | Nested:
    """A describe program's stdout: a description as JSON (ASCII or not), with bytes changed or cut
    short, nested past any sane depth, or bytes that are no UTF-8."""
    document = draw(descriptions)
    text = json.dumps(document, ensure_ascii=draw(st.booleans()), indent=draw(st.sampled_from((None, 1))))
    output = text.encode(errors="surrogatepass")  # a lone surrogate: bytes no UTF-8 decoder takes
    how = draw(st.sampled_from(("as is", "as is", "as is", "bytes", "cut", "deep")))
    if how == "bytes" and output:
        changed = bytearray(output)
        for _ in range(draw(st.integers(1, 4))):
            changed[draw(st.integers(0, len(changed) - 1))] = draw(st.integers(0, 255))
        output = bytes(changed)
    elif how == "cut":
        output = output[: draw(st.integers(0, len(output)))]
    elif how == "deep":
        depth = draw(st.sampled_from((100, 1000, 100_000)))
        opener = draw(st.sampled_from(('{"card0": {"attributes": {"model": ', '{"card0": ', "[", '{"a": ')))
        return Nested(opener, draw(st.sampled_from(("]", "}"))), depth)
    return output


@dataclasses.dataclass(frozen=True)
class Nested:
    """JSON nested ``depth`` deep, as bytes(): its repr stays short (hypothesis prints a failing input)."""

    opener: str
    closer: str
    depth: int

    def __bytes__(self) -> bytes:
        return (self.opener * self.depth + "1" + self.closer * self.depth).encode()


def assert_described_or_refused(output: bytes | Nested) -> None:
    """describe's ``output`` is refused with ValueError, as run_describe reads it, or becomes
    device values (with_read_values), a ResourceSlice's device and NFD labels, each writable as
    UTF-8, without raising anything else."""
    try:
        described = gp.parse_description(bytes(output).decode())  # run_describe's reading
    except ValueError:  # UnicodeDecodeError too: run_describe's DescribeError
        return
    for said in described.values():  # for whichever device it names: only the resource's own are kept
        device = gp.DeviceEntry("card0", "/dev/dri/card0")
        entry, problems = gp.with_read_values(DESCRIBED, device, gp.ReadValues(), said)
        assert all(isinstance(key, str) and isinstance(why, str) for key, why in problems)
        json.dumps(gp.dra_device(DESCRIBED, entry, "gopherplug.example.com"), ensure_ascii=False).encode()
        gp.nfd_features([(DESCRIBED, {entry.id: entry})]).encode()


@PROPERTIES
@given(describe_outputs())
def test_describe_output_is_device_values_or_a_refusal(output: bytes | Nested) -> None:
    assert_described_or_refused(output)


@PROPERTIES
@given(json_values)
def test_describe_output_of_any_json_shape_is_device_values_or_a_refusal(document: Any) -> None:
    assert_described_or_refused(json.dumps(document).encode())


# The soak (issue 44: "a serving plugin whose configuration file is replaced by a thousand mutated
# ones in a row, and whose describe prints a thousand mutated outputs, is alive after each and serves
# its last good devices"). One plugin in this process, serve_plugin with watch_config_file (real
# inotify) and the kubelet stand-in (real sockets); hypothesis draws the inputs in a worker thread and
# hands each to the plugin's trio thread. Each step waits for the line the plugin logs about it, and
# then for the kubelet's view: never a sleep. CI feeds GOPHERPLUG_SOAK of each (100); bench/fuzz.py
# --soak 1000 the thousand.

SOAK = int(os.environ.get("GOPHERPLUG_SOAK", "100"))
RESOURCE = "example.com/gopher"
#: The lines watch_config_file ends a reading with (or none: a valid file the same as what runs).
_CONFIG_ENDINGS = ("keeping the running configuration", "nothing to apply", "configuration reloaded", "held back")

#: describe for the soak: prints the first output queued in its first argument's directory, whose
#: file name may say to rename a device (in its second argument's directory) first, from a to b.
_DESCRIBE_SCRIPT = """
import os, sys
queue, devices = sys.argv[1], sys.argv[2]
first = min(os.listdir(queue))
with open(os.path.join(queue, first), "rb") as file:
    output = file.read()
os.unlink(os.path.join(queue, first))
_, *rename = first.split("-")
if rename:
    os.rename(os.path.join(devices, rename[0]), os.path.join(devices, rename[1]))
sys.stdout.buffer.write(output)
"""


class _Lines(logging.Handler):
    """The plugin's log lines that contain one of ``words``, each setting ``said`` (a trio.Event)."""

    def __init__(self, *words: str) -> None:
        super().__init__(logging.DEBUG)
        self.words, self.lines, self.said = words, list[str](), trio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        line = record.getMessage()
        if any(word in line for word in self.words):
            self.lines.append(line)
            self.said.set()

    async def next(self) -> str:
        await self.said.wait()
        self.said = trio.Event()
        return self.lines.pop(0)


def _served(simulator: gp.KubeletSimulator) -> dict[str, dict[str, str]]:
    """What the kubelet stand-in sees now: each streaming resource's devices (ID -> health)."""
    return {name: dict(r.devices) for name, r in simulator.resources.items() if r.streaming}


def _devices_of(config: gp.Config) -> dict[str, dict[str, str]]:
    """What ``config``'s device-plugin resources offer on this node, as the plugin would list them."""
    offered = {}
    for resource in config.resources:
        if resource.device_plugin:
            scan = gp.scan_directory(resource, config.sysfs_root, config.dev_root)
            listed = gp.list_and_watch_response(resource, scan.devices).devices
            offered[resource.name] = {device.ID: device.health for device in listed}
    return offered


def _outside_the_sandbox(config: gp.Config) -> bool:
    """Whether serving ``config`` would write or run outside the soak's directory: a CDI spec (its
    default directory is the host's), a describe or pre_start program, the DRA driver."""
    return config.dra is not None or any(r.cdi or r.describe or r.pre_start for r in config.resources)


def _drive(strategy: st.SearchStrategy[Any], count: int, step: Callable[[Any], Awaitable[bool]]) -> None:
    """In a worker thread: hypothesis draws ``count`` inputs that ``step`` (run on the plugin's trio
    thread) takes (returns True for), no shrinking: a failure is the input that failed."""

    @settings(
        max_examples=count,
        database=None,
        deadline=None,
        derandomize=bool(os.environ.get("CI")),
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def feed(value: Any) -> None:
        assume(trio.from_thread.run(step, value))

    feed()


def soak(configurations: int, outputs: int, tried: dict[str, int] | None = None) -> str:
    """Feed a serving plugin ``configurations`` mutated configuration files, then its describe
    ``outputs`` mutated outputs; after each, check it serves its last good devices. Returns what
    it tried, for a person; ``tried`` counts as it goes (what was tried before a failure)."""
    with tempfile.TemporaryDirectory(prefix="gp-soak-") as root:
        return trio.run(_soak, pathlib.Path(root), configurations, outputs, tried if tried is not None else {})


async def _soak(root: pathlib.Path, configurations: int, outputs: int, tried: dict[str, int]) -> str:
    plugin_dir, devices, queue = root / "dp", root / "dev", root / "queue"
    for directory in (plugin_dir, devices, queue):
        directory.mkdir()
    for name in ("g1", "g2", "b0"):
        (devices / name).touch()
    path = root / "gopherplug.yaml"
    base = {"name": RESOURCE, "directory": str(devices), "pattern": "[gb]*", "env": "GOPHER_DEVICES", "replicas": 2}
    text = yaml.safe_dump({"device_plugin_dir": str(plugin_dir), "resources": [base]})
    path.write_text(text)
    config = gp.load_config(str(path))
    logger = logging.getLogger("gopherplug")
    level, logger.level = logger.level, logging.INFO
    tried.update(configurations=0, refused=0, applied=0, outputs=0)
    try:
        async with trio.open_nursery() as nursery:
            simulator = await nursery.start(gp.KubeletSimulator(str(plugin_dir)).run)
            updates = gp.watch_config_file(str(path), current=config)
            await nursery.start(functools.partial(gp.serve_plugin, config, updates=updates))
            running, refused_last = config, False
            with trio.fail_after(60):
                await simulator.wait_until(lambda s: _served(s) == _devices_of(running))

            async def configuration(mutated: str) -> bool:
                nonlocal running, refused_last
                mutated = (mutated + f"\n# {tried['configurations']}\n").encode(errors="replace").decode()
                try:
                    new: gp.Config | None = gp._config_from_text(mutated, str(path), None)
                except gp.ConfigError:
                    new = None
                except Exception:  # the properties above fail for it; here: the plugin must live
                    new = None
                if new is not None and _outside_the_sandbox(new):
                    return False
                tried["configurations"] += 1
                before = _served(simulator)
                with trio.fail_after(60):
                    lines = _Lines(*_CONFIG_ENDINGS)
                    logger.addHandler(lines)
                    try:
                        (root / "next.yaml").write_text(mutated)
                        os.replace(root / "next.yaml", path)  # replaced, as a ConfigMap or an editor does
                        if new is not None and new == running and not refused_last:
                            return True  # the same as what runs: nothing is said, nothing changes
                        line = await lines.next()
                    finally:
                        logger.removeHandler(lines)
                    await trio.testing.wait_all_tasks_blocked()
                    refused_last = "keeping the running configuration" in line
                    if "configuration reloaded" not in line:
                        tried["refused"] += 1
                        assert _served(simulator) == before, (mutated, line)
                        return True
                    assert new is not None, (mutated, line)
                    tried["applied"] += 1
                    running = new
                    expected = _devices_of(new)
                    await simulator.wait_until(
                        lambda s: {n: d for n, d in _served(s).items() if n in expected} == expected
                    )
                return True

            mutations = mutations_of(text, yaml.safe_load(text))
            await trio.to_thread.run_sync(_drive, mutations, configurations, configuration)

            # describe: each output is queued with a good one after it, which names a device the
            # resource does not have (soak-N: a line that differs each time). The mutated output's
            # run renames a device (the script does), so the good one is run next, and its line says
            # both were read. The kubelet then sees the devices as they are.
            script = root / "describe.py"
            script.write_text(_DESCRIBE_SCRIPT)
            (queue / f"{0:08d}").write_text('{"soak-0": {}}')
            described = {**base, "pattern": "*", "replicas": 1}
            described["describe"] = [sys.executable, str(script), str(queue), str(devices)]
            with trio.fail_after(60):
                lines = _Lines("described soak-0,")
                logger.addHandler(lines)
                try:
                    path.write_text(yaml.safe_dump({"device_plugin_dir": str(plugin_dir), "resources": [described]}))
                    await lines.next()
                finally:
                    logger.removeHandler(lines)

            async def output(printed: bytes | Nested) -> bool:
                number = tried["outputs"] = tried["outputs"] + 1
                (queue / f"{2 * number:08d}-a{number}-b{number}").write_bytes(bytes(printed))
                (queue / f"{2 * number + 1:08d}").write_text(json.dumps({f"soak-{number}": {}}))
                with trio.fail_after(60):
                    lines = _Lines(f"described soak-{number},")
                    logger.addHandler(lines)
                    try:
                        os.rename(devices / f"b{number - 1}", devices / f"a{number}")
                        await lines.next()
                    finally:
                        logger.removeHandler(lines)
                    await trio.testing.wait_all_tasks_blocked()
                expected = dict.fromkeys(["g1", "g2", f"b{number}"], gp.HEALTHY)
                assert _served(simulator)[RESOURCE] == expected, printed
                return True

            await trio.to_thread.run_sync(_drive, describe_outputs(), outputs, output)
            nursery.cancel_scope.cancel()
    finally:
        logger.level = level
    applied = f"{tried['applied']} applied, {tried['refused']} refused, the others the same as the running one"
    return f"{tried['configurations']} configurations ({applied}), {tried['outputs']} describe outputs"


def test_a_serving_plugin_outlives_mutated_configurations_and_describe_outputs() -> None:
    tried: dict[str, int] = {}
    print(soak(SOAK, SOAK, tried))
    assert (tried["configurations"], tried["outputs"]) == (SOAK, SOAK), tried  # none left out
