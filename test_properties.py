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
import json
import os
import pathlib
import subprocess
import sys
from typing import Any

import yaml
from hypothesis import HealthCheck, example, given, settings
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
KEYS = sorted(_SEED_KEYS)

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
        container, key = draw(st.sampled_from(slots))
        how = draw(st.sampled_from(["replace", "replace", "delete", "insert", "rename", "wrap", "double"]))
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
        how = draw(st.sampled_from(["byte", "cut", "double", "drop", "swap", "indent", "syntax"]))
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
def mutated_configurations(draw: st.DrawFn) -> tuple[str, str]:
    """(file name, text): a shipped configuration mutated in its data, its text, or both."""
    index = draw(st.integers(0, len(SEEDS) - 1))
    source, text = SEEDS[index]
    how = draw(st.sampled_from(["data", "text", "both"]))
    if how != "text":
        text = _dump(draw, draw(mutated_data(SEED_DATA[index][1])))
    if how != "data":
        text = draw(mutated_text(text))
    return source, text


@st.composite
def generated_configurations(draw: st.DrawFn) -> tuple[str, str]:
    """(file name, text): a document of the seeds' keys, each with a value the seeds give that key
    or one of any shape."""

    def entry() -> st.SearchStrategy[dict[Any, Any]]:
        key = st.sampled_from(KEYS)
        return st.dictionaries(key, key.flatmap(lambda k: st.sampled_from(_SEED_VALUES.get(k) or [None]) | values))

    top = draw(entry())
    if draw(st.booleans()):
        top["resources"] = draw(st.lists(entry(), max_size=3))
    return draw(st.sampled_from(["gopherplug.yaml", "a b:c.yaml", ""])), _dump(draw, top)


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


@st.composite
def descriptions(draw: st.DrawFn) -> Any:
    """What a describe program means to print: device IDs to their attributes and capacity, any
    part of it of another shape or type."""
    entry = st.fixed_dictionaries(
        {},
        optional={
            "attributes": st.dictionaries(_attribute_names, _attribute_values, max_size=5) | json_values,
            "capacity": st.dictionaries(_attribute_names, _capacity_values, max_size=3) | json_values,
            "extra": json_values,
        },
    )
    return draw(st.dictionaries(_device_ids, entry | json_values, max_size=3) | json_values)


@st.composite
def describe_outputs(draw: st.DrawFn) -> bytes | Nested:
    """A describe program's stdout: a description as JSON (ASCII or not), with bytes changed or cut
    short, nested past any sane depth, or bytes that are no UTF-8."""
    document = draw(descriptions())
    text = json.dumps(document, ensure_ascii=draw(st.booleans()), indent=draw(st.sampled_from([None, 1])))
    output = text.encode(errors="surrogatepass")  # a lone surrogate: bytes no UTF-8 decoder takes
    how = draw(st.sampled_from(["as is", "as is", "as is", "bytes", "cut", "deep"]))
    if how == "bytes" and output:
        changed = bytearray(output)
        for _ in range(draw(st.integers(1, 4))):
            changed[draw(st.integers(0, len(changed) - 1))] = draw(st.integers(0, 255))
        output = bytes(changed)
    elif how == "cut":
        output = output[: draw(st.integers(0, len(output)))]
    elif how == "deep":
        depth = draw(st.sampled_from([100, 1000, 100_000]))
        opener = draw(st.sampled_from(['{"card0": {"attributes": {"model": ', '{"card0": ', "[", '{"a": ']))
        return Nested(opener, draw(st.sampled_from(["]", "}"])), depth)
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
