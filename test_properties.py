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

import json
import os
import re

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
