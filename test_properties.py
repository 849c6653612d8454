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

import decimal
import json
import os
import re
from decimal import Decimal

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gopherplug as gp

PROPERTIES = settings(
    max_examples=int(os.environ.get("HYPOTHESIS_EXAMPLES", "300")),
    deadline=None,
    derandomize=bool(os.environ.get("CI")),
    suppress_health_check=[HealthCheck.too_slow],
)


# Quantities; attribute and capacity names and values; CDI names (issue 44, helper "rules")
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


@PROPERTIES
@given(st.one_of(_quantity_texts, st.text(), st.integers(), st.integers(-(10**5000), 10**5000), st.floats()))
def test_a_quantity_is_refused_or_canonical_never_an_exception(written):
    stored = gp.canonical_quantity(written)
    assert stored is None or gp.canonical_quantity(stored) == stored  # what the server stores, it keeps


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


# NFD label names and values; HTTP request heads (issue 44, helper "boundary")

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


@PROPERTIES
@given(resource_names, attribute_names, typed_values)
def test_every_nfd_label_gopherplug_builds_is_one_nfd_takes(resource_name, key, typed):
    name, value = gp.nfd_label_name(resource_name, key), gp.nfd_label_value(typed)
    assert not nfd_refuses(name, value or "0"), (name, value)
    assert name == gp.nfd_label_name(resource_name, key)  # the same label on every node


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


# Configuration documents; describe output (issue 44, helper "fuzz")
