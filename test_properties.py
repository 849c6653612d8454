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
import decimal
import functools
import json
import logging
import os
import pathlib
import re
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable
from decimal import Decimal
from typing import Any

import pytest
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


# Quantities; attribute and capacity names and values; CDI names
#
# What the API server does, said again here in the test's own words (Decimal arithmetic, bytes and
# ASCII as Go counts them) and compared with what gopherplug says: k8s.io/apimachinery
# pkg/api/resource/quantity.go (ParseQuantity, CanonicalizeBytes), kubernetes/kubernetes
# pkg/apis/resource/validation/validation.go (1.36: validateQualifiedName, validateDeviceAttribute)
# and container-device-interface pkg/parser/parser.go (ValidateVendorName, ValidateClassName,
# ValidateDeviceName). gopherplug may refuse more than the API server (a refusal costs a line);
# it must never accept what the server refuses (that costs the pool), nor raise.

_WIDE = decimal.Context(prec=decimal.MAX_PREC, Emax=decimal.MAX_EMAX, Emin=decimal.MIN_EMIN)
_BINARY = {s: 1024 ** (i + 1) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_NUMBER = re.compile(r"([+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+))(.*)", re.ASCII | re.DOTALL)


def _quantity_value(text: str) -> tuple[Decimal, bool]:
    """What a quantity that parses says, by Decimal arithmetic, and whether its suffix is binary."""
    match = _NUMBER.fullmatch(text)
    assert match is not None
    number, suffix = Decimal(match[1]), match[2]
    with decimal.localcontext(_WIDE):
        if suffix in _BINARY:
            return number * _BINARY[suffix], True
        return number.scaleb(_DECIMAL[suffix] if suffix in _DECIMAL else int(suffix[1:])), False


def _stored_value(text: str) -> Decimal:
    """The value the API server keeps for what was written: rounded up to 1n (away from zero), a
    binary one capped at 2^63-1 (ParseQuantity)."""
    value, binary = _quantity_value(text)
    with decimal.localcontext(_WIDE):
        if binary and abs(value) > 2**63 - 1:
            value = Decimal(2**63 - 1).copy_sign(value)
        return value.scaleb(9).to_integral_value(decimal.ROUND_UP).scaleb(-9)


_quantity_texts = st.builds(
    lambda sign, whole, dot, fraction, suffix: f"{sign}{whole}{'.' if dot else ''}{fraction}{suffix}",
    st.sampled_from(["", "+", "-"]),
    st.text("0123456789", max_size=25),
    st.booleans(),
    st.text("0123456789", max_size=12),
    st.one_of(
        st.sampled_from([*_BINARY, *_DECIMAL, "e", "i", "K", "ki", "EE", "Ei3", " ", "\u0661", "\u00b2"]),
        st.builds(
            lambda e, n: f"{e}{n:+d}" if n % 2 else f"{e}{n}",
            st.sampled_from("eE"),
            st.one_of(st.integers(-40, 40), st.integers(-(2**40), 2**40), st.integers(2**31 - 3, 2**31 + 3)),
        ),
    ),
)


@pytest.mark.slow
@PROPERTIES
@given(st.one_of(_quantity_texts, st.text(), st.integers(), st.integers(-(10**5000), 10**5000), st.floats()))
def test_a_quantity_is_refused_or_canonical_never_an_exception(written):
    stored = gp.canonical_quantity(written)
    assert stored is None or gp.canonical_quantity(stored) == stored  # what the server stores, it keeps


@pytest.mark.slow
@PROPERTIES
@given(_quantity_texts)
def test_a_quantity_keeps_the_value_the_api_server_keeps(written):
    if (stored := gp.canonical_quantity(written)) is not None:
        assert _quantity_value(stored)[0] == _stored_value(written)
        assert gp.canonical_quantity(stored) == stored


# k8s.io/apimachinery pkg/api/resource/quantity_test.go (kubernetes/apimachinery v0.36.3, the
# library of Kubernetes 1.36), TestQuantityParse: what each parses as (mantissa, base-10 exponent).
_APIMACHINERY_PARSE = [
    ("0", 0, 0),
    ("0n", 0, 0),
    ("0u", 0, 0),
    ("0m", 0, 0),
    ("0Ki", 0, 0),
    ("0k", 0, 0),
    ("0Mi", 0, 0),
    ("0M", 0, 0),
    ("0Gi", 0, 0),
    ("0G", 0, 0),
    ("0Ti", 0, 0),
    ("0T", 0, 0),
    ("1", 1, 0),
    ("1Ki", 1024, 0),
    ("8Ki", 8192, 0),
    ("7Mi", 7340032, 0),
    ("6Gi", 6442450944, 0),
    ("5Ti", 5497558138880, 0),
    ("4Pi", 4503599627370496, 0),
    ("3Ei", 3458764513820540928, 0),
    ("10Ti", 10995116277760, 0),
    ("100Ti", 109951162777600, 0),
    ("5n", 5, -9),
    ("4u", 4, -6),
    ("3m", 3, -3),
    ("9", 9, 0),
    ("8k", 8, 3),
    ("50k", 5, 4),
    ("7M", 7, 6),
    ("6G", 6, 9),
    ("5T", 5, 12),
    ("40T", 4, 13),
    ("300T", 3, 14),
    ("2P", 2, 15),
    ("1E", 1, 18),
    ("1E-3", 1, -3),
    ("1e3", 1, 3),
    ("1E6", 1, 6),
    ("1e9", 1, 9),
    ("1E12", 1, 12),
    ("1e15", 1, 15),
    ("1E18", 1, 18),
    ("1e14", 1, 14),
    ("1e13", 1, 13),
    ("100.035k", 100035, 0),
    ("0.001", 1, -3),
    ("0.0005k", 5, -1),
    ("0.005", 5, -3),
    ("0.05", 5, -2),
    ("0.5", 5, -1),
    ("0.00050k", 5, -1),
    ("0.00500", 5, -3),
    ("0.05000", 5, -2),
    ("0.50000", 5, -1),
    ("0.5e0", 5, -1),
    ("0.5e-1", 5, -2),
    ("0.5e-2", 5, -3),
    ("10.035M", 10035, 3),
    ("1.2e3", 12, 2),
    ("1.3E+6", 13, 5),
    ("1.40e9", 14, 8),
    ("1.53E12", 153, 10),
    ("1.6e15", 16, 14),
    ("1.7E18", 17, 17),
    ("9.01", 901, -2),
    ("8.1k", 81, 2),
    ("7.123456M", 7123456, 0),
    ("6.987654321G", 6987654321, 0),
    ("5.444T", 5444, 9),
    ("40.1T", 401, 11),
    ("300.2T", 3002, 11),
    ("2.5P", 25, 14),
    ("1.01E", 101, 16),
    ("3.001n", 4, -9),
    ("1.1E-9", 2, -9),
    ("0.0000000001", 1, -9),
    ("0.0000000005", 1, -9),
    ("0.00000000050", 1, -9),
    ("0.5e-9", 1, -9),
    ("0.9n", 1, -9),
    ("0.00000012345", 124, -9),
    ("0.00000012354", 124, -9),
    ("9Ei", 9223372036854775807, 0),
    ("9223372036854775807Ki", 9223372036854775807, 0),
    ("12E", 12, 18),
    ("100.035Ki", 10243584, -2),
    ("0.5Mi", 524288, 0),
    ("0.05Gi", 536870912, -1),
    ("0.025Ti", 274877906944, -1),
    ("0.000000000001Ki", 2, -9),
    (".001", 1, -3),
    (".0001k", 100, -3),
    ("1.", 1, 0),
    ("1.G", 1, 9),
]
# ... its invalid strings, which every release refuses
_APIMACHINERY_INVALID = ["1.1.M", "1+1.0M", "0.1mi", "0.1am", "aoeu", ".5i", "1i", "-3.01i", "-3.01e-", " 1", "1 ", ""]
# ... TestQuantityParseEmit: (written, stored)
_APIMACHINERY_EMIT = [
    ("1Ki", "1Ki"),
    ("1Mi", "1Mi"),
    ("1Gi", "1Gi"),
    ("1024Mi", "1Gi"),
    ("1000M", "1G"),
    (".001Ki", "1024m"),
    (".000001Ki", "1024u"),
    (".000000001Ki", "1024n"),
    (".000000000001Ki", "2n"),
]
# ... TestQuantityString: (stored, another way to write it; "" none)
_APIMACHINERY_STRING = [
    ("1Gi", "1024Mi"),
    ("300Mi", "307200Ki"),
    ("6Ki", ""),
    ("1001Gi", "1025024Mi"),
    ("1Ti", "1024Gi"),
    ("5", "5000m"),
    ("500m", "0.5"),
    ("1G", "1000M"),
    ("1G", "0.001T"),
    ("1G", ""),
    ("1G", ""),
    ("1m", "1000u"),
    ("80m", ""),
    ("1080m", "1.08"),
    ("1080m", "1080000000n"),
    ("1080m", ""),
    ("300M", ""),
    ("1T", ""),
    ("1234567M", ""),
    ("1234567m", ""),
    ("3k", ""),
    ("1025", ""),
    ("0", ""),
    ("0", ""),
    ("1e9", ".001e12"),
    ("1e-3", "0.001e0"),
    ("1e-9", "1000e-12"),
    ("80e-3", ""),
    ("300e6", ""),
    ("1e12", ""),
    ("1e3", ""),
    ("3e3", ""),
    ("3k", ""),
    ("0", "00"),
    ("1n", ""),
    ("80n", ""),
    ("1080n", ""),
    ("1080n", ""),
    ("1080n", ""),
    ("1u", ""),
    ("80u", ""),
    ("1080u", ""),
]
# kubernetes/kubernetes staging/src/k8s.io/apimachinery/pkg/api/resource/quantity_test.go (after
# 1.36), TestInterpretExponentInt32Bounds: the exponents accepted; 1.36 wraps the others in 32 bits.
_APIMACHINERY_EXPONENTS = [
    ("e14", True),
    ("E2147483647", True),
    ("E-2147483647", True),
    ("E2147483648", False),
    ("E-2147483648", False),
    ("E4294967297", False),
    ("E8589934592", False),
    ("E9223372036854775807", False),
    ("E9223372036854775808", False),
    ("E6024865272343", False),
]


def test_quantities_as_apimachinerys_own_tables_say():
    for written, mantissa, exponent in _APIMACHINERY_PARSE:
        for sign in ("", "+", "-"):  # TestQuantityParse tries each with an explicit sign too
            stored = gp.canonical_quantity(sign + written)
            assert stored is not None, written
            assert _quantity_value(stored)[0] == Decimal(mantissa).scaleb(exponent) * (-1 if sign == "-" else 1)
    assert [written for written in _APIMACHINERY_INVALID if gp.canonical_quantity(written) is not None] == []
    for written, stored in _APIMACHINERY_EMIT:
        assert (gp.canonical_quantity(written), gp.canonical_quantity("-" + written)) == (stored, "-" + stored)
    for stored, alternate in _APIMACHINERY_STRING:
        assert gp.canonical_quantity(stored) == stored
        assert gp.canonical_quantity(alternate or stored) == stored
    for suffix, accepted in _APIMACHINERY_EXPONENTS:
        assert (gp.canonical_quantity("1" + suffix) is not None) == accepted, suffix


def _go_c_identifier(text: str) -> bool:
    """validateCIdentifier: at most 32 bytes, a C identifier (IsCIdentifier: ASCII)."""
    return len(text.encode()) <= 32 and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", text) is not None


def _go_driver_name(text: str) -> bool:
    """validateDriverName: at most 63 bytes; strings.ToLower of it a DNS subdomain (IsDNS1123Subdomain).
    Go's ToLower makes two characters ASCII: the Kelvin sign and the dotted capital I."""
    lowered = "".join({"\u212a": "k", "\u0130": "i"}.get(c, c.lower() if c.isascii() else c) for c in text)
    dns = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
    return len(text.encode()) <= 63 and len(lowered.encode()) <= 253 and re.fullmatch(dns, lowered) is not None


def _go_qualified_name(name: str) -> bool:
    """validateQualifiedName (1.36): a C identifier, or a driver name, "/" and a C identifier. Three
    parts or more pass (a TODO there: "a/b/c" is implicitly accepted)."""
    parts = name.split("/")
    if len(parts) == 1:
        return _go_c_identifier(name)
    return len(parts) > 2 or (_go_driver_name(parts[0]) and _go_c_identifier(parts[1]))


_name_texts = st.one_of(
    st.text("aZ_09-./\u212a\u0130\u00e9\u0661", max_size=80),
    st.builds(
        lambda domain, name: f"{domain}/{name}",
        st.from_regex(r"[a-zA-Z0-9][-a-zA-Z0-9.]{0,70}", fullmatch=True),
        st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,36}", fullmatch=True),
    ),
)


@pytest.mark.slow
@PROPERTIES
@given(_name_texts)
def test_an_attribute_or_capacity_name_is_one_the_api_server_takes(name):
    accepted = gp.attribute_name_problem(name) == ""
    assert not accepted or _go_qualified_name(name)  # never one the server refuses
    if _go_qualified_name(name) and name.isascii() and name.count("/") <= 1:
        assert accepted  # and every plain one it takes


_SEMVER = (
    r"(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)"
    r"(-(0|[1-9][0-9]*|[0-9]*[a-zA-Z-][0-9a-zA-Z-]*)(\.(0|[1-9][0-9]*|[0-9]*[a-zA-Z-][0-9a-zA-Z-]*))*)?"
    r"(\+[0-9a-zA-Z-]+(\.[0-9a-zA-Z-]+)*)?"
)  # validation.go's semverRe; Go's \d is [0-9]


@pytest.mark.slow
@PROPERTIES
@given(
    st.one_of(
        st.text(max_size=80),
        st.text(st.characters(categories=["Cs", "Lu", "Nd"]), max_size=8),  # a lone surrogate: JSON's "\ud800"
        st.text("0123456789.+-aZ\u0661", max_size=70),
        st.integers(-(2**70), 2**70),
        st.booleans(),
    )
)
def test_an_attribute_value_is_one_the_api_server_takes(value):
    for kind in gp.ATTRIBUTE_TYPES:
        accepted = gp.attribute_value_problem(kind, value) == ""
        if kind == "int":
            go = type(value) is int and -(2**63) <= value < 2**63
        elif kind == "bool":
            go = isinstance(value, bool)
        else:
            # A lone surrogate (JSON's "\ud800") is no UTF-8: Go's decoder would keep U+FFFD, another string.
            go = isinstance(value, str) and not re.search("[\ud800-\udfff]", value)
            go = go and len(value.encode()) <= 64 and (kind == "string" or re.fullmatch(_SEMVER, value) is not None)
        assert accepted == go, kind


def _cdi_name(name: str, also: str = "") -> bool:
    """validateVendorOrClassName (also ":" : ValidateDeviceName, which lets a device name begin with
    a digit), ASCII letters and digits as IsLetter and IsDigit say. A one-character vendor or class
    panics CDI v1.1.0 (name[1:len(name)-1]), so it counts as refused."""
    first = r"[A-Za-z0-9]" if also else r"[A-Za-z]"
    if also and len(name) == 1:
        return re.fullmatch(first, name) is not None
    return re.fullmatch(rf"{first}[A-Za-z0-9_.{also}-]*[A-Za-z0-9]", name) is not None


@pytest.mark.slow
@PROPERTIES
@given(
    st.from_regex(r"[a-z0-9]([-a-z0-9]{0,20}[a-z0-9])?(\.[a-z0-9]([-a-z0-9]{0,10}[a-z0-9])?){0,3}", fullmatch=True),
    st.from_regex(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,58}[A-Za-z0-9])?", fullmatch=True),
    st.text("aZ09_.-/:\u00e9", max_size=40),
)
def test_cdi_names_are_ones_cdi_takes(driver, short, kind):
    vendor, _, device_class = gp.dra_cdi_kind(driver, f"a.b/{short}").partition("/")
    assert _cdi_name(vendor) and _cdi_name(device_class) and len(device_class) <= 63
    try:
        gp._parse_cdi({"kind": kind}, "cfg.yaml", "cdi")
    except gp.ConfigError:
        pass
    else:
        vendor, _, device_class = kind.partition("/")
        assert _cdi_name(vendor) and _cdi_name(device_class)
    assert (gp._CDI_NAME.fullmatch(kind) is not None) == _cdi_name(kind, ":")  # a device's name in a spec


# NFD label names and values; HTTP request heads

# NFD's own rule for a label it takes from a feature file (validate.Label in kubernetes-sigs/
# node-feature-discovery pkg/apis/nfd/validate/validate.go): the key a qualified name
# (IsQualifiedName: an optional DNS-subdomain prefix of at most 253, "/", a name of at most 63),
# its prefix not kubernetes.io's but for NFD's own, and the value IsValidLabelValue. Go's regexps
# are ASCII; so are Python's character classes here.
_NFD_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
_NFD_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def nfd_refuses(key: str, value: str) -> str:
    """Why NFD would drop the label ``key=value`` from a feature file, or ""."""
    prefix, _, name = key.rpartition("/")
    if not (_NFD_NAME.fullmatch(name) and len(name) <= 63):
        return f"name {name!r}"
    if not prefix or len(prefix) > 253 or not _DNS_SUBDOMAIN.fullmatch(prefix):
        return f"prefix {prefix!r}"
    if (prefix == "kubernetes.io" or prefix.endswith(".kubernetes.io")) and prefix != gp.NFD_LABEL_NAMESPACE:
        return f"namespace {prefix!r}"
    if not (_NFD_VALUE.fullmatch(value) and len(value) <= 63):
        return f"value {value!r}"
    return ""


_LABEL = r"[a-z0-9]([-a-z0-9]{0,10}[a-z0-9])?"
resource_names = st.from_regex(rf"\A{_LABEL}(\.{_LABEL}){{0,3}}/[A-Za-z0-9]([-A-Za-z0-9_.]{{0,30}}[A-Za-z0-9])?\Z")
attribute_names = st.from_regex(rf"\A({_LABEL}(\.{_LABEL}){{0,2}}/)?[A-Za-z_][A-Za-z0-9_]{{0,31}}\Z")
typed_values = st.one_of(
    st.builds(lambda v: {"bool": v}, st.booleans()),
    st.builds(lambda v: {"int": v}, st.integers(-(2**63), 2**63 - 1)),
    st.builds(lambda v: {"string": v}, st.text(max_size=80)),
    st.builds(lambda v: {"version": v}, st.text(max_size=80)),
)


@pytest.mark.slow
@PROPERTIES
@given(resource_names, attribute_names, typed_values)
def test_every_nfd_label_gopherplug_builds_is_one_nfd_takes(resource_name, key, typed):
    name, value = gp.nfd_label_name(resource_name, key), gp.nfd_label_value(typed)
    assert not nfd_refuses(name, value or "0"), (name, value)
    assert name == gp.nfd_label_name(resource_name, key)  # the same label on every node


@pytest.mark.slow
@PROPERTIES
@given(
    resource_names,
    st.dictionaries(attribute_names, st.one_of(st.booleans(), st.integers(0, 10**6), st.text()), max_size=6),
)
def test_every_line_of_the_nfd_feature_file_is_a_label_nfd_takes(resource_name, attributes):
    document = {"resources": [{"name": resource_name, "directory": "/dev", "attributes": attributes}]}
    try:
        config = gp.parse_config(json.dumps(document), "t.yaml")
    except gp.ConfigError:
        return  # refused with its line: no label at all
    resource = config.resources[0]
    text = gp.nfd_features([(resource, {"0": gp.DeviceEntry("0", "/dev/null")})])
    for line in text.splitlines():
        if not line.startswith("#"):
            key, _, value = line.partition("=")
            assert not nfd_refuses(key, value), line


@pytest.mark.slow
@PROPERTIES
@given(
    st.binary(max_size=300)
    | st.builds(
        lambda m, t, v: m + b" " + t + b" " + v + b"\r\n\r\n",
        st.sampled_from([b"GET", b"HEAD", b"POST", b""]),
        st.binary(max_size=60) | st.sampled_from([b"/healthz", b"http://h/healthz", b"http://", b"//", b"?"]),
        st.sampled_from([b"HTTP/1.1", b"HTTP/", b"http/1.0", b""]),
    )
)
def test_any_request_head_gets_an_answer(request):
    health = gp.Health()
    for answer in (
        gp.health_answer(health, request),
        gp._http_answer(request, ("/metrics",), lambda: (200, b""), "text/plain"),
    ):
        head, _, _ = answer.partition(b"\r\n\r\n")
        status = head.split(b"\r\n")[0]
        assert status.split(b" ", 2)[1] in (b"200", b"400", b"404", b"405"), answer
        assert f"Content-Length: {len(answer) - len(head) - 4}".encode() in head or request.startswith(b"HEAD"), answer


# Configuration documents; describe output
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
    'resources: ["\\U00420577"]',  # PyYAML's scanner: ValueError from chr() past U+10FFFF
    "resources: !!int ",  # PyYAML's int constructor: IndexError on the empty value
    # a crash once found: the exa suffix, an exponent past any decimal context (canonical_quantity)
    "resources: [{name: example.com/g, directory: /dev/g, capacity: {memory: 2E}}]",
    "resources: [{name: example.com/g, directory: /dev/g, capacity: {memory: 1e9999999}}]",
]


@pytest.mark.slow
@PROPERTIES
@given(mutated_configurations())
def test_a_mutated_shipped_configuration_is_a_config_or_one_line(document: tuple[str, str]) -> None:
    assert_config_or_one_line(document[1], document[0])


for _text in FOUND:
    test_a_mutated_shipped_configuration_is_a_config_or_one_line = example(("found.yaml", _text))(
        test_a_mutated_shipped_configuration_is_a_config_or_one_line
    )


@pytest.mark.slow
def test_check_config_says_one_line_and_no_traceback(tmp_path: pathlib.Path) -> None:
    """`gopherplug check-config` on what the properties found, and on a file that is no UTF-8: valid
    (exit 0), or invalid (exit 2) with one line on stderr that names the file; never a traceback."""
    texts = [text.encode(errors="surrogatepass") for text in FOUND] + [b"resources: [\xff\xfe]"]
    for number, text in enumerate(texts):
        path = tmp_path / f"found-{number}.yaml"
        path.write_bytes(text)
        command = [sys.executable, str(HERE / "gopherplug.py"), "check-config", "--config", str(path)]
        result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
        said = result.stderr.strip()
        assert result.returncode in (0, 2) and "Traceback" not in said, (text, said)
        if result.returncode:
            assert said.startswith(f"gopherplug: {path}: ") and len(said.splitlines()) == 1, (text, said)


@pytest.mark.slow
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


@pytest.mark.slow
@PROPERTIES
@given(describe_outputs())
def test_describe_output_is_device_values_or_a_refusal(output: bytes | Nested) -> None:
    assert_described_or_refused(output)


@pytest.mark.slow
@PROPERTIES
@given(json_values)
def test_describe_output_of_any_json_shape_is_device_values_or_a_refusal(document: Any) -> None:
    assert_described_or_refused(json.dumps(document).encode())


# The soak ("a serving plugin whose configuration file is replaced by a thousand mutated
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
    # setLevel, not an assignment to .level: logging caches isEnabledFor per logger, and only
    # setLevel clears it (a test before this one may have left INFO cached as off).
    level = logger.level
    logger.setLevel(logging.INFO)
    tried.update(configurations=0, refused=0, applied=0, outputs=0)
    try:
        async with trio.open_nursery() as nursery:
            simulator = await nursery.start(gp.KubeletSimulator(str(plugin_dir)).run)
            updates = lambda current: gp.watch_config_file(str(path), current=current)  # noqa: E731 - one a run
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
        logger.setLevel(level)
    applied = f"{tried['applied']} applied, {tried['refused']} refused, the others the same as the running one"
    return f"{tried['configurations']} configurations ({applied}), {tried['outputs']} describe outputs"


@pytest.mark.slow
def test_a_serving_plugin_outlives_mutated_configurations_and_describe_outputs() -> None:
    tried: dict[str, int] = {}
    print(soak(SOAK, SOAK, tried))
    assert (tried["configurations"], tried["outputs"]) == (SOAK, SOAK), tried  # none left out
