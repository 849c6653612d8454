"""gopherplug_standins: Kubernetes in miniature, as strict as the real thing, for tests.

A device plugin or DRA driver is tested against what it talks to: the kubelet, the API server,
the scheduler. gopherplug.py carries the lenient stand-ins its ``demo`` runs (KubeletSimulator,
DraKubeletSimulator, LenientApiServer); this module carries what only tests need, so that a node
runs, and a reader of the product reads, none of it (as trio.testing stands beside trio):

  1. Releases          the Kubernetes versions the stand-ins speak for (1.34 to 1.37), each with
                       its default feature gates and an admin's overrides: every stand-in below
                       takes one and behaves as that release does
  2. Validation        the API server's own checks of ResourceSlices and ResourceClaims, with its
                       words: a test's object is one a cluster can have, or it fails as there
  3. ApiServerSimulator LenientApiServer made strict: the 422s, the fields of disabled feature gates
                       dropped, DeviceClasses, /version, TLS, tokens, failures on demand, watches
                       that end and expire as the real ones do, bookmarks, RBAC refusals,
                       requests counted by client
  4. SchedulerSimulator kube-scheduler's allocation of claims and extended resources, with CEL
                       evaluated for real (gopherplug_cel's DeviceSelector, with cel-python from
                       the cel extra), consumable capacity, taints and prioritized lists as the
                       release's gates have them
  5. DraKubeletSimulator the product's, with the kubelet's handling of extended resources, and the
                       health stream opened only where ResourceHealthStatus is on
  6. PodResourcesSimulator the product's, with the kubelet's rate limit
  7. cdi_container_env  the container runtime's CDI injection: the env a container gets from the
                       CDI devices the kubelet names, as containerd applies the spec files

KubeletSimulator and UnexpectedAdmissionError are the product's, and CELError, DeviceSelector and
cel_device gopherplug_cel's, named here too, so that a test takes every stand-in from one place.
The wheel ships this module for users' own tests; the images do not (the Dockerfile copies
gopherplug.py alone). It needs the `dra` extra (h11) and, for the scheduler's CEL, the `cel` extra.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import math
import os
import random
import re
import socket
import struct
import time
import urllib.parse
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import trio

import gopherplug
from gopherplug import (
    _DNS_LABEL_LENGTH,
    _DNS_SUBDOMAIN,
    _DNS_SUBDOMAIN_LENGTH,
    _LABEL_VALUE,
    _LABEL_VALUE_LENGTH,
    _UUID,
    DRA_ATTRIBUTE_MAX_LENGTH,
    DRA_MAX_DEVICES_PER_SLICE,
    DRA_MAX_DEVICES_PER_SLICE_WITH_TAINTS,
    DRA_POOL_NAME_MAX_LENGTH,
    DRA_STATUS_DATA_MAX_LENGTH,
    ClaimError,
    GopherplugError,
    KubeletSimulator,
    LenientApiServer,
    RPCError,
    StatusCode,
    UnexpectedAdmissionError,
    _Http,
    _status,
    go_json,
    resource_name_problem,
)
from gopherplug_cel import CELError, DeviceSelector, _quantity, cel_device

__all__ = [
    "EXTENDED_RESOURCE_CLAIM_ANNOTATION",
    "FEATURE_GATE_HISTORY",
    "IMPLICIT_EXTENDED_RESOURCE_PREFIX",
    "KUBERNETES_VERSIONS",
    "ApiServerSimulator",
    "CDIInjectionError",
    "CELError",
    "DeviceSelector",
    "DraKubeletSimulator",
    "KubeletSimulator",
    "Placement",
    "PodResourcesSimulator",
    "Release",
    "SchedulerSimulator",
    "UnexpectedAdmissionError",
    "UnschedulableError",
    "cdi_container_env",
    "cel_device",
    "gate_spec",
    "release",
    "resource_claim_causes",
    "resource_claim_status_causes",
    "resource_slice_causes",
]


########################################################################################################
# 1. Releases
#
# A stand-in speaks for one Kubernetes release with its default feature gates, as a cluster of that
# release runs unless its admin changed them: a test says which release it is about, and the same
# flow runs against each. Pure data, and one function that checks an admin's overrides.
########################################################################################################

#: The Kubernetes releases gopherplug supports (resource.k8s.io/v1 is served from 1.34), oldest first.
KUBERNETES_VERSIONS = ("1.34", "1.35", "1.36", "1.37")

#: The feature gates the stand-ins follow, each as its versioned defaults: (from release, stage,
#: on by default, locked to its default). Copied from defaultVersionedKubernetesFeatureGates in
#: kubernetes/kubernetes pkg/features/kube_features.go as of v1.36.2; the 1.37 entries from the main
#: branch (where the DRA gates are listed alike), planned for 1.37: DRADeviceTaints GA, DRAExtendedResource
#: GA and locked, DRAResourceClaimDeviceStatus GA and locked, DRAPrioritizedList locked.
FEATURE_GATE_HISTORY: dict[str, tuple[tuple[str, str, bool, bool], ...]] = {
    # firstAvailable: a request's prioritized list of subrequests
    "DRAPrioritizedList": (
        ("1.33", "alpha", False, False),
        ("1.34", "beta", True, False),
        ("1.36", "GA", True, False),
        ("1.37", "GA", True, True),
    ),
    # adminAccess in a claim's request (in a namespace labelled resource.kubernetes.io/admin-access)
    "DRAAdminAccess": (("1.32", "alpha", False, False), ("1.34", "beta", True, False), ("1.36", "GA", True, True)),
    # a claim's status.devices, written by the driver
    "DRAResourceClaimDeviceStatus": (
        ("1.32", "alpha", False, False),
        ("1.33", "beta", True, False),
        ("1.37", "GA", True, True),
    ),
    # a device's taints in a ResourceSlice, and the allocator's respect for them
    "DRADeviceTaints": (("1.33", "alpha", False, False), ("1.36", "beta", True, False), ("1.37", "GA", True, False)),
    # allowMultipleAllocations and a capacity's requestPolicy: a device shared among claims
    "DRAConsumableCapacity": (("1.34", "alpha", False, False), ("1.36", "beta", True, False)),
    # a DeviceClass's extendedResourceName: pods asking through resources.limits get a claim
    "DRAExtendedResource": (
        ("1.34", "alpha", False, False),
        ("1.36", "beta", True, False),
        ("1.37", "GA", True, True),
    ),
    # the kubelet's DRA health stream (NodeWatchResources) and a pod's status.allocatedResourcesStatus
    "ResourceHealthStatus": (("1.31", "alpha", False, False), ("1.36", "beta", True, False)),
    # the kubelet's PodResources API lists DRA devices (`gopherplug who`), and answers Get
    "KubeletPodResourcesDynamicResources": (
        ("1.27", "alpha", False, False),
        ("1.34", "beta", True, False),
        ("1.36", "GA", True, True),
    ),
    "KubeletPodResourcesGet": (
        ("1.27", "alpha", False, False),
        ("1.34", "beta", True, False),
        ("1.36", "GA", True, True),
    ),
}


def _minor(version: str) -> int:
    return int(version.split(".")[1])


def gate_spec(gate: str, version: str) -> tuple[str, bool, bool]:
    """A gate's (stage, default, locked) in a release: its newest entry from that release or before."""
    entries = [entry for entry in FEATURE_GATE_HISTORY[gate] if _minor(entry[0]) <= _minor(version)]
    _, stage, default, locked = entries[-1]
    return stage, default, locked


@dataclass(frozen=True)
class Release:
    """One Kubernetes release as a cluster runs it: its version ("1.35") and its feature gates, the
    release's defaults with what an admin changed (``--feature-gates``). Make one with release()."""

    version: str
    gates: Mapping[str, bool]

    def enabled(self, gate: str) -> bool:
        """Whether a gate of FEATURE_GATE_HISTORY is on."""
        return self.gates[gate]

    @property
    def git_version(self) -> str:
        """The version as components report it (/version's gitVersion, a Node's kubeletVersion)."""
        return f"v{self.version}.0"

    def version_info(self) -> dict[str, str]:
        """What the API server answers on /version (k8s.io/apimachinery pkg/version Info)."""
        major, minor = self.version.split(".")
        return {
            "major": major,
            "minor": minor,
            "gitVersion": self.git_version,
            "gitCommit": "0" * 40,
            "gitTreeState": "clean",
            "buildDate": "2026-01-01T00:00:00Z",
            "goVersion": "go1.25.0",
            "compiler": "gc",
            "platform": "linux/amd64",
        }


def release(version: str | Release = "1.36", **overrides: bool) -> Release:
    """A Release of ``version`` (one of KUBERNETES_VERSIONS; a Release is returned as it is) with its
    default gates, and ``overrides`` as an admin sets them (``release("1.35", DRADeviceTaints=True)``).
    ValueError, in the component's words (k8s.io/component-base featuregate), for a gate the stand-ins
    do not know or one locked to its default."""
    if isinstance(version, Release):
        if overrides:
            return release(version.version, **{**version.gates, **overrides})
        return version
    if version not in KUBERNETES_VERSIONS:
        raise ValueError(f"Kubernetes {version}: the stand-ins speak for {', '.join(KUBERNETES_VERSIONS)}")
    gates = {gate: gate_spec(gate, version)[1] for gate in FEATURE_GATE_HISTORY}
    for gate, value in overrides.items():
        if gate not in gates:
            raise ValueError(f"unrecognized feature gate: {gate}")
        _, default, locked = gate_spec(gate, version)
        if locked and value != default:
            raise ValueError(
                f"cannot set feature gate {gate} to {str(value).lower()}, feature is locked to {str(default).lower()}"
            )
        gates[gate] = value
    return Release(version, gates)


########################################################################################################
# 2. Validation, as the API server does it
#
# Each function returns the causes a 422 lists (field, reason, message), in the API server's words
# (kubernetes/kubernetes pkg/apis/resource/validation/validation.go): a test's object is one a
# cluster can have. Pure: no I/O, no state.
########################################################################################################

#: At most this many taints on one device (DeviceTaintsMaxLength in k8s.io/api/resource/v1 types.go)
DRA_MAX_TAINTS_PER_DEVICE = 16

_DNS_SUBDOMAIN_PROBLEM = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must "
    "start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is "
    "'[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
)
_DNS_LABEL_PROBLEM = (
    "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and "
    "end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is "
    "'[a-z0-9]([-a-z0-9]*[a-z0-9])?')"
)


def _cause(field: str, reason: str, body: str) -> dict[str, str]:
    """One field error as a Status lists it in details.causes (k8s.io/apimachinery field.Error)."""
    return {"reason": reason, "message": body, "field": field}


def _dns_causes(field: str, value: str, limit: int, label: bool) -> list[dict[str, str]]:
    causes = []
    if len(value) > limit:
        causes.append(
            _cause(
                field,
                "FieldValueInvalid",
                f"Invalid value: {json.dumps(value)}: must be no more than {limit} characters",
            )
        )
    pattern = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?" if label else _DNS_SUBDOMAIN.pattern
    if not re.fullmatch(pattern, value):
        problem = _DNS_LABEL_PROBLEM if label else _DNS_SUBDOMAIN_PROBLEM
        causes.append(_cause(field, "FieldValueInvalid", f"Invalid value: {json.dumps(value)}: {problem}"))
    return causes


#: An attribute name's parts (k8s.io/api/resource/v1 types.go): the domain at most DeviceMaxDomainLength
#: (a driver name's limit), the name a C identifier of at most DeviceMaxIDLength.
_DRA_DOMAIN_LENGTH = 63
_DRA_ID_LENGTH = 32
_C_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SEMVER = re.compile(  # Go's \d is ASCII: [0-9]
    r"(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)"
    r"(-(0|[1-9][0-9]*|[0-9]*[a-zA-Z-][0-9a-zA-Z-]*)(\.(0|[1-9][0-9]*|[0-9]*[a-zA-Z-][0-9a-zA-Z-]*))*)?"
    r"(\+[0-9a-zA-Z-]+(\.[0-9a-zA-Z-]+)*)?"
)


def _attribute_causes(field: str, name: str, value: Any) -> list[dict[str, str]]:
    """What the API server refuses in one device attribute (validateQualifiedName and
    validateDeviceAttribute in pkg/apis/resource/validation/validation.go): the name a C identifier
    of at most 32 characters, optionally after a domain and one "/" (a DNS subdomain of at most 63,
    validateDriverName); the value exactly one of bool, int, string and version, a string or
    version at most 64 characters, a version a semantic version (semver.org 2.0.0)."""
    causes = []
    parts = name.split("/")
    identifier = parts[-1]
    if len(parts) > 2:
        message = f"Invalid value: {json.dumps(name)}: must be either a C identifier or a domain, followed by a "
        message += "slash and a C identifier"
        return [_cause(field, "FieldValueInvalid", message)]
    if len(parts) == 2:
        domain = parts[0]
        if not domain:
            causes.append(_cause(field, "FieldValueInvalid", 'Invalid value: "": the domain must not be empty'))
        else:
            if len(domain) > _DRA_DOMAIN_LENGTH:
                causes.append(
                    _cause(field, "FieldValueTooLong", f"Too long: may not be more than {_DRA_DOMAIN_LENGTH} bytes")
                )
            causes += _dns_causes(field, domain.lower(), _DNS_SUBDOMAIN_LENGTH, False)
        if not identifier:
            causes.append(_cause(field, "FieldValueInvalid", 'Invalid value: "": the name must not be empty'))
    if identifier or len(parts) != 2:
        if len(identifier) > _DRA_ID_LENGTH:
            causes.append(_cause(field, "FieldValueTooLong", f"Too long: may not be more than {_DRA_ID_LENGTH} bytes"))
        if not _C_IDENTIFIER.fullmatch(identifier):
            causes.append(
                _cause(
                    field,
                    "FieldValueInvalid",
                    f"Invalid value: {json.dumps(identifier)}: a valid C identifier must start with alphabetic "
                    "character or '_', followed by a string of alphanumeric characters or '_' (e.g. 'my_name',  or "
                    "'MY_NAME',  or 'MyName', regex used for validation is '[A-Za-z_][A-Za-z0-9_]*')",
                )
            )
    kinds = [kind for kind in ("bool", "int", "string", "version") if kind in (value or {})]
    # What the JSON decoder refuses before validation (a 400 from the real API server, said here as
    # a cause): a value not of its field's Go type (bool, int64, string).
    for kind in kinds:
        given = value[kind]
        fits = {
            "bool": isinstance(given, bool),
            "int": isinstance(given, int) and not isinstance(given, bool) and -(2**63) <= given < 2**63,
        }.get(kind, isinstance(given, str))
        if not fits:
            go_type = {"bool": "bool", "int": "int64"}.get(kind, "string")
            message = f"json: cannot unmarshal {json.dumps(given)} into Go struct field DeviceAttribute.{kind} of "
            causes.append(_cause(f"{field}.{kind}", "FieldValueTypeInvalid", message + f"type {go_type}"))
    for kind in ("string", "version"):
        text = str((value or {}).get(kind, ""))
        if kind == "version" and kind in kinds and not _SEMVER.fullmatch(text):
            causes.append(
                _cause(
                    f"{field}.version",
                    "FieldValueInvalid",
                    f"Invalid value: {json.dumps(text)}: must be a string compatible with semver.org spec 2.0.0",
                )
            )
        if len(text.encode()) > DRA_ATTRIBUTE_MAX_LENGTH:
            causes.append(
                _cause(
                    f"{field}.{kind}",
                    "FieldValueTooLong",
                    f"Too long: may not be more than {DRA_ATTRIBUTE_MAX_LENGTH} bytes",
                )
            )
    if len(kinds) != 1:
        causes.append(_cause(field, "FieldValueInvalid", "Invalid value: exactly one value must be specified"))
    return causes


_QUALIFIED_NAME_PART = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
#: validDeviceTaintEffects in validation.go ("None" is valid from Kubernetes 1.35 on)
_DRA_TAINT_EFFECTS_VALID = ("NoExecute", "NoSchedule", "None")


def _taint_causes(field: str, taint: Mapping[str, Any]) -> list[dict[str, str]]:
    """What the API server refuses in one device taint (validateDeviceTaint in
    pkg/apis/resource/validation/validation.go): the key a label name (ValidateLabelName: a name
    part of at most 63 letters, digits, "-", "_" and "." starting and ending alphanumeric, after an
    optional DNS subdomain prefix and "/"), the value when given a label value, the effect one of
    validDeviceTaintEffects."""
    causes = []
    key = str(taint.get("key", ""))
    prefix, _, name = key.rpartition("/")
    if key.count("/") > 1 or not name or len(name) > _LABEL_VALUE_LENGTH or not _QUALIFIED_NAME_PART.fullmatch(name):
        causes.append(
            _cause(
                f"{field}.key",
                "FieldValueInvalid",
                f"Invalid value: {json.dumps(key)}: name part must consist of alphanumeric characters, '-', '_' or "
                f"'.', and must start and end with an alphanumeric character, at most {_LABEL_VALUE_LENGTH} "
                "characters, with an optional DNS subdomain prefix and '/'",
            )
        )
    elif "/" in key:
        causes += _dns_causes(f"{field}.key", prefix, _DNS_SUBDOMAIN_LENGTH, False)
    value = str(taint.get("value", ""))
    if value and (len(value) > _LABEL_VALUE_LENGTH or not _LABEL_VALUE.fullmatch(value)):
        causes.append(
            _cause(
                f"{field}.value",
                "FieldValueInvalid",
                f"Invalid value: {json.dumps(value)}: a valid label must be an empty string or consist of alphanumeric "
                f"characters, '-', '_' or '.', and must start and end with an alphanumeric character, at most "
                f"{_LABEL_VALUE_LENGTH} characters",
            )
        )
    effect = str(taint.get("effect", ""))
    if not effect:
        causes.append(_cause(f"{field}.effect", "FieldValueRequired", "Required value"))
    elif effect not in _DRA_TAINT_EFFECTS_VALID:
        supported = ", ".join(json.dumps(e) for e in _DRA_TAINT_EFFECTS_VALID)
        causes.append(
            _cause(
                f"{field}.effect",
                "FieldValueNotSupported",
                f"Unsupported value: {json.dumps(effect)}: supported values: {supported}",
            )
        )
    return causes


#: The most attributes and capacities one device may have together
#: (ResourceSliceMaxAttributesAndCapacitiesPerDevice in k8s.io/api resource/v1)
_DRA_MAX_ATTRIBUTES_AND_CAPACITIES = 32


def _capacity_causes(field: str, capacity: Any, shared: bool) -> list[dict[str, str]]:
    """What the API server refuses in one device capacity (validateMultiAllocatableDeviceCapacity,
    validateSingleAllocatableDeviceCapacity and validateRequestPolicy in
    pkg/apis/resource/validation/validation.go): a quantity as its value; a requestPolicy only on
    a device that allows multiple allocations (``shared``), then validValues or validRange, not
    both, with a default that is one of the values, or within the range: min required and within
    the value, default at least min, max within the value and not below min or the default, min
    plus a step within the value, default and max whole steps from min."""
    capacity = capacity if isinstance(capacity, dict) else {}
    value = _quantity(capacity.get("value"))
    if value is None:
        return [_cause(f"{field}.value", "FieldValueInvalid", f"Invalid value: {json.dumps(capacity.get('value'))}")]
    policy = capacity.get("requestPolicy")
    if policy is None:
        return []
    where = f"{field}.requestPolicy"
    if not shared:
        return [_cause(where, "FieldValueForbidden", "Forbidden: allowMultipleAllocations must be true")]
    causes = []
    default = _quantity(policy.get("default")) if "default" in policy else None
    values, valid_range = policy.get("validValues") or [], policy.get("validRange")

    def invalid(at: str, shown: Any, why: str) -> None:
        causes.append(_cause(f"{where}.{at}", "FieldValueInvalid", f"Invalid value: {json.dumps(str(shown))}: {why}"))

    if values and valid_range is not None:
        message = "Forbidden: exactly one policy can be specified, cannot specify "
        message += '"validValues" and "validRange" at the same time'
        return [_cause(where, "FieldValueForbidden", message)]
    if (values or valid_range is not None) and default is None:
        which = "validValues" if values else "validRange"
        return [_cause(f"{where}.default", "FieldValueRequired", f"Required value: required when {which} is defined")]
    if values:
        numbers = [_quantity(v) for v in values]
        for index, (a, b) in enumerate(itertools.pairwise(numbers)):
            if a is not None and b is not None and a > b:
                invalid(f"validValues[{index + 1}]", values[index + 1], "values must be sorted in ascending order")
        for index, number in enumerate(numbers):
            if number is not None and number > value:
                invalid(
                    f"validValues[{index}]", values[index], f"option is larger than capacity value: {capacity['value']}"
                )
        if default not in numbers:
            invalid("validValues", policy["default"], "default value is not valid according to the requestPolicy")
    elif valid_range is not None:
        low = _quantity(valid_range.get("min")) if "min" in valid_range else None
        if low is None:
            message = "Required value: required when validRange is defined"
            return [_cause(f"{where}.validRange.min", "FieldValueRequired", message)]
        assert default is not None
        if low > value:
            invalid("validRange.min", valid_range["min"], f"min is larger than capacity value: {capacity['value']}")
        if default < low:
            invalid("validRange.min", policy["default"], f"default is less than min: {valid_range['min']}")
        high = _quantity(valid_range["max"]) if "max" in valid_range else None
        if high is not None:
            if low > high:
                invalid("validRange.max", valid_range["min"], f"min is larger than max: {valid_range['max']}")
            if high > value:
                invalid("validRange.max", valid_range["max"], f"max is larger than capacity value: {capacity['value']}")
            if default > high:
                invalid("validRange.max", policy["default"], f"default is more than max: {valid_range['max']}")
        step = _quantity(valid_range["step"]) if "step" in valid_range else None
        if step:
            if low + step > value:
                invalid(
                    "validRange.step",
                    valid_range["step"],
                    f"one step {low + step} is larger than capacity value: {capacity['value']}",
                )
            for checked in [default, *([high] if high is not None else [])]:
                if (checked - low) % step:
                    why = f"value is not a multiple of a given step ({valid_range['step']}) from ({valid_range['min']})"
                    invalid("validRange.step", checked, why)
    return causes


def resource_slice_causes(item: Mapping[str, Any], old: Mapping[str, Any] | None = None) -> list[dict[str, str]]:
    """What the API server refuses in a resource.k8s.io/v1 ResourceSlice (``old``: the stored one it
    would replace), as the causes of its 422: the checks of ValidateResourceSlice and
    ValidateResourceSliceUpdate (kubernetes/kubernetes pkg/apis/resource/validation/validation.go)
    that a driver's slices can fail. The name is a DNS subdomain; the pool name at most 253
    characters, each "/" part a DNS subdomain; resourceSliceCount above 0, generation not below;
    at most 128 devices, each named by a DNS label, each attribute's name and value as
    _attribute_causes says, at most 16 taints each as _taint_causes says (and at most 64 devices
    in a slice where any has taints), capacities as _capacity_causes says, named as attributes
    are, at most 32 attributes and capacities together; pool name, driver and node immutable; an owner
    reference's UID not empty (ValidateOwnerReferences in apimachinery's api/validation)."""
    causes = _dns_causes("metadata.name", str(item.get("metadata", {}).get("name", "")), _DNS_SUBDOMAIN_LENGTH, False)
    for owner in item.get("metadata", {}).get("ownerReferences", []):  # ValidateOwnerReferences
        if not owner.get("uid"):
            causes.append(
                _cause("metadata.ownerReferences.uid", "FieldValueInvalid", 'Invalid value: "": uid must not be empty')
            )
    spec = item.get("spec") or {}
    pool = spec.get("pool") or {}
    pool_name = str(pool.get("name", ""))
    if not pool_name:
        causes.append(_cause("spec.pool.name", "FieldValueRequired", "Required value"))
    else:
        if len(pool_name) > DRA_POOL_NAME_MAX_LENGTH:
            causes.append(
                _cause(
                    "spec.pool.name",
                    "FieldValueTooLong",
                    f"Too long: must have at most {DRA_POOL_NAME_MAX_LENGTH} bytes",
                )
            )
        for part in pool_name.split("/"):
            causes += _dns_causes("spec.pool.name", part, _DNS_SUBDOMAIN_LENGTH, False)
    if (count := pool.get("resourceSliceCount", 0)) <= 0:
        causes.append(
            _cause(
                "spec.pool.resourceSliceCount",
                "FieldValueInvalid",
                f"Invalid value: {count}: must be greater than zero",
            )
        )
    if (generation := pool.get("generation", 0)) < 0:
        causes.append(
            _cause(
                "spec.pool.generation",
                "FieldValueInvalid",
                f"Invalid value: {generation}: must be greater than or equal to zero",
            )
        )
    devices = spec.get("devices") or []
    tainted = any(device.get("taints") for device in devices)
    most = DRA_MAX_DEVICES_PER_SLICE_WITH_TAINTS if tainted else DRA_MAX_DEVICES_PER_SLICE
    if len(devices) > most:
        causes.append(
            _cause("spec.devices", "FieldValueTooMany", f"Too many: {len(devices)}: must have at most {most} items")
        )
    for index, device in enumerate(devices):
        causes += _dns_causes(f"spec.devices[{index}].name", str(device.get("name", "")), _DNS_LABEL_LENGTH, True)
        for name, value in (device.get("attributes") or {}).items():
            causes += _attribute_causes(f"spec.devices[{index}].attributes[{name}]", name, value)
        capacities = device.get("capacity") or {}
        shared = device.get("allowMultipleAllocations") is True
        for name, capacity in capacities.items():
            field = f"spec.devices[{index}].capacity[{name}]"
            # A capacity's name is an attribute's (validateQualifiedName): the causes of the name alone
            causes += [c for c in _attribute_causes(field, name, {"bool": True}) if c["field"] == field]
            causes += _capacity_causes(field, capacity, shared)
        if (together := len(device.get("attributes") or {}) + len(capacities)) > _DRA_MAX_ATTRIBUTES_AND_CAPACITIES:
            causes.append(
                _cause(
                    f"spec.devices[{index}]",
                    "FieldValueInvalid",
                    f"Invalid value: {together}: the total number of attributes and capacities must not exceed "
                    f"{_DRA_MAX_ATTRIBUTES_AND_CAPACITIES}",
                )
            )
        taints = device.get("taints") or []
        if len(taints) > DRA_MAX_TAINTS_PER_DEVICE:
            causes.append(
                _cause(
                    f"spec.devices[{index}].taints",
                    "FieldValueTooMany",
                    f"Too many: {len(taints)}: must have at most {DRA_MAX_TAINTS_PER_DEVICE} items",
                )
            )
        for number, taint in enumerate(taints):
            causes += _taint_causes(f"spec.devices[{index}].taints[{number}]", taint)
    if old is not None:
        old_spec = old.get("spec") or {}
        for field, new_value, old_value in (
            ("spec.pool.name", pool_name, (old_spec.get("pool") or {}).get("name")),
            ("spec.driver", spec.get("driver"), old_spec.get("driver")),
            ("spec.nodeName", spec.get("nodeName"), old_spec.get("nodeName")),
        ):
            if new_value != old_value:
                causes.append(
                    _cause(field, "FieldValueInvalid", f"Invalid value: {json.dumps(new_value)}: field is immutable")
                )
    return causes


def resource_claim_causes(claim: Mapping[str, Any]) -> list[dict[str, str]]:
    """What the API server refuses in a resource.k8s.io/v1 ResourceClaim's allocation, as the causes
    of its 422 (validateDeviceRequestAllocationResult in pkg/apis/resource/validation/validation.go):
    each result names a request of the claim, or "<request>/<subrequest>" of a request with
    firstAvailable (the scheduler's choice from a prioritized list), a pool name as slices have
    them, and a device by a DNS label."""
    requests: dict[str, set[str] | None] = {}
    for request in ((claim.get("spec") or {}).get("devices") or {}).get("requests") or []:
        subrequests = request.get("firstAvailable")
        requests[request.get("name", "")] = {sub.get("name", "") for sub in subrequests} if subrequests else None
    causes = []
    allocation = (claim.get("status") or {}).get("allocation") or {}
    for index, result in enumerate((allocation.get("devices") or {}).get("results") or []):
        where = f"status.allocation.devices.results[{index}]"
        name = str(result.get("request", ""))
        main, _, sub = name.partition("/")
        known = main in requests and (sub == "" if requests[main] is None else sub in (requests[main] or ()))
        if not known or name.count("/") > 1:
            causes.append(
                _cause(
                    f"{where}.request",
                    "FieldValueInvalid",
                    f"Invalid value: {json.dumps(name)}: must be the name of a request in the claim or the name of a "
                    "request and a subrequest separated by '/'",
                )
            )
        if not result.get("driver"):
            causes.append(_cause(f"{where}.driver", "FieldValueRequired", "Required value"))
        for part in str(result.get("pool", "")).split("/"):
            causes += _dns_causes(f"{where}.pool", part, _DNS_SUBDOMAIN_LENGTH, False)
        causes += _dns_causes(f"{where}.device", str(result.get("device", "")), _DNS_LABEL_LENGTH, True)
        if "shareID" in result:
            causes += _share_id_causes(f"{where}.shareID", result["shareID"])
        for name, quantity in (result.get("consumedCapacity") or {}).items():
            if _quantity(quantity) is None:
                causes.append(
                    _cause(
                        f"{where}.consumedCapacity[{name}]",
                        "FieldValueInvalid",
                        f"Invalid value: {json.dumps(quantity)}",
                    )
                )
    return causes


def _share_id_causes(field: str, share: Any) -> list[dict[str, str]]:
    """A shareID the API server refuses (validateUID in pkg/apis/resource/validation/validation.go):
    anything but a UUID in RFC 4122 form with lower-case hexadecimal digits."""
    if _UUID.fullmatch(str(share)):
        return []
    message = (
        f"Invalid value: {json.dumps(share)}: uid must be in RFC 4122 normalized form, "
        "`xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` with lowercase hexadecimal characters"
    )
    return [_cause(field, "FieldValueInvalid", message)]


def resource_claim_status_causes(claim: Mapping[str, Any], devices: list[Mapping[str, Any]]) -> list[dict[str, str]]:
    """What the API server refuses in a ResourceClaim's status.devices, as the causes of its 422
    (validateDeviceStatus in pkg/apis/resource/validation/validation.go): each entry names a
    driver (a DNS subdomain of at most 63 characters), a pool and a device as slices do, and must
    be an allocated device of the claim (a result with the same driver, pool, device and shareID,
    a share of a shared device being its own entry); its data, when given, a JSON object of at most
    10 KiB; no entry twice."""
    results = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []
    allocated = {(r.get("driver"), r.get("pool"), r.get("device"), r.get("shareID")) for r in results}
    causes, seen = [], set()
    for index, entry in enumerate(devices):
        where = f"status.devices[{index}]"
        driver, pool, device = str(entry.get("driver", "")), str(entry.get("pool", "")), str(entry.get("device", ""))
        causes += _dns_causes(f"{where}.driver", driver, _DRA_DOMAIN_LENGTH, False)
        for part in pool.split("/"):
            causes += _dns_causes(f"{where}.pool", part, _DNS_SUBDOMAIN_LENGTH, False)
        causes += _dns_causes(f"{where}.device", device, _DNS_LABEL_LENGTH, True)
        share = entry.get("shareID")
        if share is not None:
            causes += _share_id_causes(f"{where}.shareID", share)
        key = (driver, pool, device, share)
        shown = f"{driver}/{pool}/{device}" + (f"/{share}" if share else "")  # structured.SharedDeviceID
        if key not in allocated:
            causes.append(
                _cause(
                    where, "FieldValueInvalid", f'Invalid value: "{shown}": must be an allocated device in the claim'
                )
            )
        if key in seen:
            causes.append(_cause(where, "FieldValueDuplicate", f'Duplicate value: "{shown}"'))
        seen.add(key)
        if "data" in entry:
            data = entry["data"]
            if len(json.dumps(data)) > DRA_STATUS_DATA_MAX_LENGTH:
                causes.append(
                    _cause(
                        f"{where}.data",
                        "FieldValueTooLong",
                        f"Too long: may not be more than {DRA_STATUS_DATA_MAX_LENGTH} bytes",
                    )
                )
            elif not isinstance(data, dict):
                causes.append(
                    _cause(
                        f"{where}.data",
                        "FieldValueInvalid",
                        "Invalid value: <value omitted>: must be a valid JSON object",
                    )
                )
    return causes


def _invalid(kind: str, group: str, name: str, causes: list[dict[str, str]]) -> dict[str, Any]:
    """The API server's 422 for an object that fails validation: one message naming every error
    (apierrors.NewInvalid: one error bare, several in brackets), and each as a cause."""
    errors = [f"{cause['field']}: {cause['message']}" for cause in causes]
    listed = errors[0] if len(errors) == 1 else f"[{', '.join(errors)}]"
    status = _status(422, "Invalid", f'{kind}.{group} "{name}" is invalid: {listed}')
    status["details"] = {"name": name, "group": group, "kind": kind, "causes": causes}
    return status


########################################################################################################
# 3. The API server, strict
#
# gopherplug.LenientApiServer serves the requests; this class fills in its hooks.
########################################################################################################


#: The API server's --min-request-timeout by default (seconds): a watch that asks for no
#: timeoutSeconds is ended after a random time between this and twice this (getTimeout in
#: kubernetes/kubernetes staging/src/k8s.io/apiserver/pkg/endpoints/handlers/watch.go).
MIN_REQUEST_TIMEOUT = 1800.0

#: How often the watch cache sends a bookmark to a watch that asked for them; it sends one more 2 s
#: before it ends the watch (defaultBookmarkFrequency in staging/src/k8s.io/apiserver/pkg/storage/
#: cacher/cacher.go; nextBookmarkTime in cache_watcher.go).
BOOKMARK_SECONDS = 60.0

#: What the API server calls each resource a driver asks for, by the path's last part.
_KINDS = {"resourceslices": ("resource.k8s.io/v1", "ResourceSlice"), "nodes": ("v1", "Node")}


def request_verb_and_resource(method: str, target: str) -> tuple[str, str]:
    """The API server's verb and resource of a request, as its audit log and its
    apiserver_request_total metric name them (RequestInfoFactory in kubernetes/kubernetes
    staging/src/k8s.io/apiserver/pkg/endpoints/request/requestinfo.go): a GET of a collection is
    "list", or "watch" with watch=true; of one object "get"; POST "create", PUT "update", PATCH
    "patch", DELETE "delete". The resource is its plural, with its subresource ("resourceclaims/status")."""
    url = urllib.parse.urlsplit(target)
    parts = url.path.strip("/").split("/")
    parts = parts[2:] if parts[0] == "api" else parts[3:]  # /api/v1/..., /apis/<group>/<version>/...
    if len(parts) >= 2 and parts[0] == "namespaces":
        parts = parts[2:]
    named = len(parts) >= 2
    resource = "/".join(parts[0:1] + parts[2:3])
    query = dict(urllib.parse.parse_qsl(url.query))
    if method == "GET":
        verb = "get" if named else "watch" if query.get("watch") in ("true", "1") else "list"
    else:
        verb = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}.get(method, method.lower())
    return verb, resource


_HTML = "<html><body><h1>{0} {1}</h1>\nThe server is temporarily unable to service your request.</body></html>\n"
_INTERNAL = go_json(_status(500, "InternalError", "Internal error occurred: etcdserver: leader changed"))

#: The shapes of an error answer that ApiServerSimulator.garble() gives: (status, Content-Type ("":
#: none), body). HAProxy's and nginx's pages for a backend down or slow, a server that names no
#: type, a Status with a charset, a body that is not JSON, a 429 of priority and fairness; "reset":
#: a 500 cut off mid-body by a reset; "close": no answer, the connection closed; "hang": no answer.
ERROR_SHAPES: dict[str, tuple[int, str, bytes]] = {
    "html-502": (502, "text/html", _HTML.format(502, "Bad Gateway").encode()),
    "html-503": (503, "text/html", _HTML.format(503, "Service Unavailable").encode()),
    "html-504": (504, "text/html", _HTML.format(504, "Gateway Time-out").encode()),
    "503-no-type": (503, "", b"upstream connect error or disconnect/reset before headers"),
    "json-charset": (500, "application/json; charset=utf-8", _INTERNAL),
    "500-not-json": (500, "application/json", b'{"kind": "Status", "message": '),
    "429": (429, "application/json", go_json(_status(429, "TooManyRequests", "too many requests, please try again"))),
    "reset": (500, "application/json", _INTERNAL),
    "close": (0, "", b""),
    "hang": (0, "", b""),
}
_SLICE_HEAD = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": "s", "uid": "u"}}


def _node_list(status: dict[str, Any]) -> bytes:
    """A list of one Node, node-1, with this status: what a driver's list of its Node is answered."""
    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-1", "uid": "uid-1"}, **status}
    return go_json({"apiVersion": "v1", "kind": "NodeList", "metadata": {"resourceVersion": "1"}, "items": [node]})


_LIST_HEAD = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSliceList", "metadata": {"resourceVersion": "1"}}
#: 200 answers of the wrong shape that garble() gives, as ERROR_SHAPES: a listed slice without
#: metadata, a slice (a write's answer) without spec, a listed Node whose status or allocatable is no mapping.
WRONG_SHAPES: dict[str, tuple[int, str, bytes]] = {
    "item-without-metadata": (200, "application/json", go_json({**_LIST_HEAD, "items": [{"spec": {}}]})),
    "slice-without-spec": (200, "application/json", go_json(_SLICE_HEAD)),
    "node-status-not-a-mapping": (200, "application/json", _node_list({"status": "Ready"})),
    "node-allocatable-a-list": (200, "application/json", _node_list({"status": {"allocatable": ["1"]}})),
}


class ApiServerSimulator(LenientApiServer):
    """The API server a DRA driver talks to, as strict as the real one: gopherplug.LenientApiServer
    (Nodes, claims, slices; list, watch, writes, status apply: read its docstring first) with every
    check a test needs.

    - It refuses a slice the real API server refuses (``resource_slice_causes``) with the same 422,
      and lists it in ``refused``; likewise a claim's status.devices (``resource_claim_status_causes``),
      and ``put_claim`` raises ValueError for an allocation the real one would refuse.
    - It speaks for one Kubernetes release (``version``: "1.36" unless told, or a Release with an
      admin's gates; ``release``) and serves its /version. ``disabled_gates`` names the gates
      that are off, the release's to begin with (a test may add to it): with DRADeviceTaints among
      them, a write loses its devices' taints unless the stored slice has some already, with
      DRAConsumableCapacity allowMultipleAllocations and each capacity's requestPolicy (its value
      stays), unless the stored slice has one, as dropDisabledFields in
      pkg/registry/resource/resourceslice/strategy.go does; with DRAExtendedResource a DeviceClass
      loses its extendedResourceName unless the stored one has it
      (pkg/registry/resource/deviceclass/strategy.go).
    - A taint written without timeAdded gets ``clock()``, to the second, on every create and update:
      SetDefaults_DeviceTaint (pkg/apis/resource/v1/defaults.go) knows no old object. Keeping an
      old value is the writer's part (copyTaintTimeAdded in the Go helper's resourceslice controller).
    - ``put_device_class`` stores a DeviceClass as an admin's kubectl apply would (``device_classes``,
      by name); ``put_node`` gives a Node the status.nodeInfo a kubelet of ``kubelet_version``
      reports (the release's unless told: a kubelet may be up to three minor versions older).
    - ``ssl_context`` makes it HTTPS; ``tokens`` (a set, changed at will) are the bearer tokens it
      accepts, others get 401; ``forbidden_tokens`` get 403; ``bearers`` lists each request's token.
    - ``fail()`` fails the next writes on demand (``cut_unanswered()`` cuts those it leaves
      unanswered), ``expire_watches()`` ends the watches with 410, ``mangle_watches()`` writes bytes
      of its caller's into them (a mangling proxy), ``hold_cache()`` keeps the watch cache behind
      (a list at a newer version: 504 Too large resource version),
      ``down`` refuses every request by closing the connection, ``delay`` holds every answer back
      that many seconds; ``attempts`` lists each slice write, and each write failed on demand,
      with its time and status (each touches ``changed``, also one that gets no answer).
    - ``garble()`` answers the next requests (any verb, or one) in one of the shapes of ERROR_SHAPES,
      as a proxy or load balancer in front of the real server does: an HTML 502/503/504 page, a
      503 without Content-Type, a Status as "application/json; charset=utf-8", a 500 whose body is
      not JSON, a 429 with Retry-After, a body cut off by a reset, a connection closed unanswered,
      no answer at all (ERROR_SHAPES); or a 200 of the wrong shape (WRONG_SHAPES).
    - ``requests`` counts every request by (verb, resource, user agent), as the audit log or the
      apiserver_request_total metric does (request_verb_and_resource); ``watches`` lists each watch's
      query, ``lists`` each list's. ``forbidden`` holds the (verb, resource) pairs RBAC refuses,
      with the API server's 403.
    - Watches end as the real ones do: after timeoutSeconds if asked, else after a random time between
      ``min_request_timeout`` and twice it (--min-request-timeout). A watch that asked for bookmarks
      gets one every ``bookmark_seconds`` and one just before it ends. ``compact()`` forgets the
      history (etcd's compaction): a watch from an older resourceVersion is answered 410 Gone.
      ``end_watches()`` ends the open watches now, as their timeout does.
      ``restart()`` is the API server restarting: every connection cut, the history gone.
    - ``delete_node`` deletes a Node and, as the garbage collector does, the slices it owns.
    """

    def __init__(
        self, ssl_context: Any = None, tokens: set[str] | None = None, version: str | Release = "1.36"
    ) -> None:
        super().__init__()
        self.release = release(version)  #: the Kubernetes release it speaks for
        #: DeviceClass objects by name, as stored (put_device_class)
        self.device_classes: dict[str, dict[str, Any]] = {}
        #: when now is, for a taint's timeAdded (time.time unless a test sets its own)
        self.clock: Callable[[], float] = time.time
        self.ssl_context = ssl_context
        self.tokens = tokens
        #: (verb, resource, user agent) -> requests, each counted as it comes in
        self.requests: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self.watches: list[dict[str, str]] = []  #: the query of each watch request, in order
        self.forbidden: set[tuple[str, str]] = set()  #: (verb, resource) pairs answered 403
        self.min_request_timeout = MIN_REQUEST_TIMEOUT
        self.bookmark_seconds = BOOKMARK_SECONDS
        self._oldest = 0  # compact(): the oldest resourceVersion a watch may start from
        self._restarts = 0  # restart() counts up: a watch of an earlier one is cut
        self._ends = 0  # end_watches() counts up: a watch opened before ends as at its timeout
        #: (slice or claim name, causes) of each write refused as invalid (422), in order
        self.refused: list[tuple[str, list[dict[str, str]]]] = []
        self.refused_tokens = 0
        #: tokens the server knows but refuses with 403 and this message, as an admission policy
        #: refuses a token that names no node (the manifest's), or RBAC a user without the right
        self.forbidden_tokens: dict[str, str] = {}
        self.bearers: list[str] = []  #: the bearer token of each request, in order ("" without one)
        #: each slice write: (trio time, verb, slice name, the status answered; 0: none)
        self.attempts: list[tuple[float, str, str, int]] = []
        self._failures: list[dict[str, Any]] = []  # fail(): the writes to fail, in order
        self._cuts = 0  # cut_unanswered() counts up: a write left unanswered before it is cut
        self._expired = 0  # expire_watches() counts up: a watch started before ends with 410
        self._mangles: list[bytes] = []  # mangle_watches(): what was written into the open watches
        self._cache_held: int | None = None  # hold_cache(): the version the watch cache stays at
        self.lists: list[dict[str, str]] = []  #: the query of each list request, in order
        self.down = False
        self.delay = 0.0
        self._garbled: list[dict[str, Any]] = []  # garble(): the answers to garble, in order
        #: how many answers garble() garbled, by shape
        self.garbled: collections.Counter[str] = collections.Counter()
        self.disabled_gates: set[str] = {gate for gate, on in self.release.gates.items() if not on}

    @property
    def url(self) -> str:
        return f"{'https' if self.ssl_context else 'http'}://127.0.0.1:{self.port}"

    def put_claim(self, claim: dict[str, Any]) -> None:
        """Store a claim as the scheduler left it. Raises ValueError, with the API server's 422
        message, for an allocation the real one would refuse (resource_claim_causes): a test's
        claim must be one a cluster can have."""
        if causes := resource_claim_causes(claim):
            raise ValueError(_invalid("ResourceClaim", "resource.k8s.io", claim["metadata"]["name"], causes)["message"])
        super().put_claim(claim)

    def put_node(
        self,
        name: str,
        uid: str,
        allocatable: Mapping[str, str] | None = None,
        annotations: Mapping[str, str] | None = None,
        kubelet_version: str = "",
    ) -> None:
        """A Node as LenientApiServer.put_node makes it, with the status.nodeInfo its kubelet reports:
        kubeletVersion ``kubelet_version`` ("v1.35.0"; "": the release's) and the other fields of
        NodeSystemInfo, which a client's model of a Node requires."""
        status: dict[str, Any] = {} if allocatable is None else {"allocatable": dict(allocatable)}
        status["nodeInfo"] = {
            "architecture": "amd64",
            "bootID": str(uuid.uuid5(uuid.NAMESPACE_OID, f"boot-{name}")),
            "containerRuntimeVersion": "containerd://2.1.0",
            "kernelVersion": "6.12.0",
            "kubeProxyVersion": "",
            "kubeletVersion": kubelet_version or self.release.git_version,
            "machineID": uuid.uuid5(uuid.NAMESPACE_OID, f"machine-{name}").hex,
            "operatingSystem": "linux",
            "osImage": "Debian GNU/Linux 13 (trixie)",
            "systemUUID": str(uuid.uuid5(uuid.NAMESPACE_OID, f"system-{name}")),
        }
        self._put_node(name, uid, status, annotations)  # its watch event has the nodeInfo too

    def put_device_class(self, device_class: Mapping[str, Any]) -> dict[str, Any]:
        """Store a DeviceClass (a copy) as the API server does: without extendedResourceName while
        DRAExtendedResource is off, unless the stored class of that name has one
        (dropDisabledDRAExtendedResourceFields in pkg/registry/resource/deviceclass/strategy.go). The
        class as stored."""
        item: dict[str, Any] = json.loads(json.dumps(device_class))
        old = self.device_classes.get(item["metadata"]["name"])
        in_use = old is not None and "extendedResourceName" in old.get("spec", {})
        if "DRAExtendedResource" in self.disabled_gates and not in_use:
            item.get("spec", {}).pop("extendedResourceName", None)
        self.device_classes[item["metadata"]["name"]] = item
        return item

    def count(self, verb: str = "", resource: str = "", agent: str = "") -> int:
        """How many requests came of this verb, resource and user agent ("": any)."""
        return sum(
            number
            for (v, r, a), number in self.requests.items()
            if verb in ("", v) and resource in ("", r) and agent in ("", a)
        )

    def end_watches(self) -> None:
        """End every open watch as its timeout does: a last bookmark if it asked for them, then the
        end of the response."""
        self._ends += 1
        self.changed.touch()

    def compact(self) -> None:
        """Forget every resourceVersion before now, as etcd's compaction does: a watch from one of
        them is answered 410 Gone ("too old resource version"), as the watch cache answers it."""
        self._oldest = self._version

    def restart(self) -> None:
        """The API server restarts: every open watch and connection is cut without a word, and the
        new one's watch cache starts at a version newer than any a client saw (etcd went on
        meanwhile: the nodes' leases), so that a watch resumed from before is answered 410. (Since
        KEP-1904 a real one may resume some of them: this is the worst case.)"""
        self._restarts += 1
        self._version += 1
        self.compact()
        self.changed.touch()

    def put_slice(self, item: dict[str, Any]) -> None:
        """Store a slice as someone else wrote it (e.g. an earlier run of the driver)."""
        self.slices[item["metadata"]["name"]] = self._bump("ADDED", item)

    def delete_node(self, name: str) -> None:
        """Delete a Node, and then what the garbage collector deletes: every slice whose owner
        references name it (by UID) and no other object that still exists."""
        uid = self.nodes[name]["metadata"]["uid"]
        self._bump("DELETED", self.nodes.pop(name), "nodes")
        alive = {node["metadata"]["uid"] for node in self.nodes.values()}
        for slice_name, item in list(self.slices.items()):
            owners = {owner.get("uid") for owner in item["metadata"].get("ownerReferences", [])}
            if uid in owners and not owners & alive:
                self.delete_slice(slice_name)

    def fail(self, verb: str, name: str = "", status: int = 500, *, times: int = 1, retry_after: int = 0) -> None:
        """Fail the next ``times`` writes of ``verb`` ("create", "update", "delete") to slice
        ``name`` ("": any), or ("status") to claim ``name``'s status, with ``status``, as the real
        server can: 409 (someone else's write came first), 429 (priority and fairness; with a
        Retry-After header when ``retry_after``), 500, or 0: no answer at all, until the client
        gives up (a timeout, or the plugin killed mid-write) or cut_unanswered() cuts it."""
        self._failures.append(
            {"verb": verb, "name": name, "status": status, "times": times, "retry_after": retry_after}
        )

    def cut_unanswered(self) -> None:
        """Close the connections of the writes fail() left unanswered (status 0), without a word, as a
        proxy's idle timeout or a dying API server does: to the client, the write failed and whether
        it was done is not known, as at its own timeout. A test decides when, rather than a timeout."""
        self._cuts += 1
        self.changed.touch()

    def garble(self, shape: str, *, times: int = 1, verb: str = "", resource: str = "") -> None:
        """Answer the next ``times`` requests of ``verb`` ("get", "list", "watch", "create", "update",
        "delete", "patch"; "": any) on ``resource`` ("resourceslices", "nodes"; "": any) in
        ``shape``, one of ERROR_SHAPES or WRONG_SHAPES, instead of the server's answer."""
        assert shape in ERROR_SHAPES or shape in WRONG_SHAPES, shape
        self._garbled.append({"shape": shape, "times": times, "verb": verb, "resource": resource})

    async def _garble(self, http: _Http, verb: str, resource: str) -> bool:
        connection, stream, h11 = http
        for garbled in self._garbled:
            if garbled["verb"] in ("", verb) and garbled["resource"] in ("", resource):
                garbled["times"] -= 1
                if garbled["times"] <= 0:
                    self._garbled.remove(garbled)
                break
        else:
            return False
        shape = garbled["shape"]
        self.garbled[shape] += 1
        self.changed.touch()
        if shape == "hang":
            await trio.sleep_forever()  # until the client gives up
        if shape == "close":
            await stream.aclose()
            return True
        status, content_type, body = {**ERROR_SHAPES, **WRONG_SHAPES}[shape]
        headers = [("content-length", str(len(body)))] + ([("content-type", content_type)] if content_type else [])
        headers += [("retry-after", "2")] if status in (429, 503) else []
        await stream.send_all(connection.send(h11.Response(status_code=status, headers=headers)))
        if shape == "reset":  # half the body, then the connection reset (SO_LINGER 0: an RST)
            await stream.send_all(body[: len(body) // 2])
            with contextlib.suppress(AttributeError):  # (over TLS: closed as it is)
                stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            await stream.aclose()
            return True
        await stream.send_all(connection.send(h11.Data(data=body)) + connection.send(h11.EndOfMessage()))
        return True

    def mangle_watches(self, data: bytes) -> None:
        """Write ``data`` into every open watch's stream, between two events, as a proxy or a
        broken middlebox that mangles a stream might (the API server itself never does)."""
        self._mangles.append(data)
        self.changed.touch()

    def hold_cache(self, held: bool = True) -> None:
        """Hold the watch cache at the version of now (``held``), or let it catch up again: an API
        server of an HA control plane whose cache is behind the others' (its etcd watch lagging,
        or just restarted). A list at a newer resourceVersion (other than "0" and "", which ask for
        any version and for a quorum read from etcd) is answered as the real one answers it once it
        has waited for its cache in vain: 504 "Too large resource version", with the cause
        ResourceVersionTooLarge and a Retry-After of 1 s (storage.NewTooLargeResourceVersionError)."""
        self._cache_held = self._version if held else None

    def expire_watches(self) -> None:
        """End every open watch with the ERROR event of a 410 Gone, as the API server does when the
        watch's resourceVersion fell out of its history (etcd compaction, an API server restart)."""
        self._expired += 1
        self.changed.touch()

    # The hooks of LenientApiServer, made strict.

    def _listeners(self, tcp: list[trio.SocketListener]) -> list[Any]:
        if self.ssl_context is None:
            return list(tcp)
        return [trio.SSLListener(one, self.ssl_context) for one in tcp]

    async def _hold(self) -> bool:
        if self.down:
            return True
        if self.delay:
            await trio.sleep(self.delay)
        return False

    async def _refuse(self, http: _Http, request: Any, headers: Mapping[str, str]) -> bool:
        target = request.target.decode()
        verb, resource = request_verb_and_resource(request.method.decode(), target)
        self.requests[verb, resource, headers.get("user-agent", "")] += 1
        query = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(target).query))
        if verb == "watch":
            self.watches.append(query)
        elif verb == "list":
            self.lists.append(query)
        token = headers.get("authorization", "").removeprefix("Bearer ")
        self.bearers.append(token)
        if self.tokens is not None and token not in self.tokens:
            self.refused_tokens += 1
            await self._send(http, 401, _status(401, "Unauthorized", "Unauthorized"))
            return True
        if token in self.forbidden_tokens:
            self.refused_tokens += 1
            await self._send(http, 403, _status(403, "Forbidden", self.forbidden_tokens[token]))
            return True
        if request.method == b"GET" and urllib.parse.urlsplit(target).path == "/version":
            await self._send(http, 200, self.release.version_info())
            return True
        if (verb, resource) in self.forbidden:
            group = "resource.k8s.io" if "/apis/resource.k8s.io/" in target else ""
            message = (
                f'{resource} is forbidden: User "system:serviceaccount:kube-system:gopherplug-dra" cannot {verb} '
                f'resource "{resource}" in API group "{group}" at the cluster scope'
            )
            await self._send(http, 403, _status(403, "Forbidden", message))
            return True
        if await self._garble(http, verb, resource):
            return True
        self.changed.touch()  # a request came: a test waiting for one may look
        asked = query.get("resourceVersion", "")
        if verb == "list" and self._cache_held is not None and asked.isdigit() and int(asked) > self._cache_held:
            status = _status(504, "Timeout", f"Too large resource version: {asked}, current: {self._cache_held}")
            status["details"] = {
                "causes": [{"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}],
                "retryAfterSeconds": 1,
            }
            await self._send(http, 504, status, [("retry-after", "1")])
            return True
        return False

    async def _intercept(self, http: _Http, verb: str, name: str) -> bool:
        """Answer a write that fail() asked to fail, and say so; False for any other."""
        if (failure := self._failure(verb, name)) is None:
            return False
        status = failure["status"]
        self.attempts.append((trio.current_time(), verb, name, status))
        self.changed.touch()  # a test can wait for a write that will get no answer
        if status == 0:  # until the client closes the connection, giving up, or cut_unanswered()
            cuts = self._cuts
            while self._cuts == cuts:
                await self.changed.wait_touched()
            await http[1].aclose()  # (connection, stream, h11): the stream
            return True
        reasons = {409: "Conflict", 429: "TooManyRequests", 500: "InternalError"}
        messages = {
            409: f'Operation cannot be fulfilled on resourceslices.resource.k8s.io "{name}": the object has been '
            "modified; please apply your changes to the latest version and try again",
            429: "storage is (re)initializing",
            500: "Internal error occurred: etcdserver: request timed out",
        }
        document = _status(status, reasons.get(status, "InternalError"), messages.get(status, "failed"))
        extra = [("retry-after", str(failure["retry_after"]))] if failure["retry_after"] else []
        await self._send(http, status, document, extra)
        return True

    def _failure(self, verb: str, name: str) -> dict[str, Any] | None:
        for failure in self._failures:
            if failure["verb"] == verb and failure["name"] in ("", name):
                failure["times"] -= 1
                if failure["times"] <= 0:
                    self._failures.remove(failure)
                return failure
        return None

    def _check_slice(self, item: dict[str, Any], old: Mapping[str, Any] | None) -> dict[str, Any] | None:
        self._prepare_slice(item, old)
        name = item["metadata"]["name"]
        if causes := resource_slice_causes(item, old):
            self.refused.append((name, causes))
            return _invalid("ResourceSlice", "resource.k8s.io", name, causes)
        return None

    def _check_claim_status(self, claim: Mapping[str, Any], devices: list[Mapping[str, Any]]) -> dict[str, Any] | None:
        name = claim["metadata"]["name"]
        if causes := resource_claim_status_causes(claim, devices):
            self.refused.append((name, causes))
            return _invalid("ResourceClaim", "resource.k8s.io", name, causes)
        return None

    def _written(self, verb: str, name: str, status: int) -> None:
        super()._written(verb, name, status)
        self.attempts.append((trio.current_time(), verb, name, status))

    def _prepare_slice(self, item: dict[str, Any], old: Mapping[str, Any] | None) -> None:
        """What the server does to a slice before validating and storing it: default timeAdded to
        now in taints without one (SetDefaults_DeviceTaint, at decoding: the old slice plays no
        part), drop the fields of disabled gates."""
        old_taints = any(
            taint
            for device in ((old or {}).get("spec") or {}).get("devices") or []
            for taint in device.get("taints") or []
        )
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.clock()))
        # dropDisabledDRAConsumableCapacityFields: unless the old slice used them already
        old_devices = ((old or {}).get("spec") or {}).get("devices") or []
        consumable_in_use = any(
            "allowMultipleAllocations" in device
            or any("requestPolicy" in capacity for capacity in (device.get("capacity") or {}).values())
            for device in old_devices
        )
        for device in (item.get("spec") or {}).get("devices") or []:
            if "DRADeviceTaints" in self.disabled_gates and not old_taints:
                device.pop("taints", None)
            if "DRAConsumableCapacity" in self.disabled_gates and not consumable_in_use:
                device.pop("allowMultipleAllocations", None)
                for capacity in (device.get("capacity") or {}).values():
                    capacity.pop("requestPolicy", None)
            for taint in device.get("taints") or []:
                if isinstance(taint, dict) and not taint.get("timeAdded"):
                    taint["timeAdded"] = now

    async def _watch(
        self, http: _Http, resource: str, query: Mapping[str, str], matches: Callable[[Any], bool]
    ) -> None:
        connection, stream, h11 = http
        # What ends this watch is what happens from its request on: taken before any await.
        expired, restarts, ends_seen = self._expired, self._restarts, self._ends
        mangled = len(self._mangles)
        since = int(query.get("resourceVersion") or 0)
        if query.get("resourceVersion") not in (None, "", "0") and since < self._oldest:
            # The watch cache answers before the watch starts: an HTTP 410, not an ERROR event.
            message = f"too old resource version: {since} ({self._oldest})"
            await self._send(http, 410, _status(410, "Expired", message))
            return
        await self._start_watch(http)
        timeout = float(query.get("timeoutSeconds") or 0) or self.min_request_timeout * (random.random() + 1.0)
        ends = trio.current_time() + timeout
        bookmarks = query.get("allowWatchBookmarks") == "true"
        api_version, kind = _KINDS[resource]

        async def bookmark() -> None:
            metadata = {"resourceVersion": str(self._version)}
            event = {"type": "BOOKMARK", "object": {"apiVersion": api_version, "kind": kind, "metadata": metadata}}
            await stream.send_all(connection.send(h11.Data(data=go_json(event) + b"\n")))

        next_bookmark = trio.current_time() + self.bookmark_seconds
        while not self.down and self._restarts == restarts:
            if self._expired != expired:
                message = f"too old resource version: {since} ({self._version})"
                line = go_json({"type": "ERROR", "object": _status(410, "Expired", message)}) + b"\n"
                await stream.send_all(connection.send(h11.Data(data=line)) + connection.send(h11.EndOfMessage()))
                return
            changed = self.changed.next_touch()
            for data in self._mangles[mangled:]:
                await stream.send_all(connection.send(h11.Data(data=data)))
            mangled = len(self._mangles)
            since = await self._send_events(http, resource, since, matches)
            now = trio.current_time()
            if now >= ends or self._ends != ends_seen:
                if bookmarks:
                    await bookmark()  # the real one's comes 2 s before the end: here, just before it
                await stream.send_all(connection.send(h11.EndOfMessage()))
                return
            if bookmarks and now >= next_bookmark:
                await bookmark()
                next_bookmark = now + self.bookmark_seconds
            with trio.move_on_at(min(ends, next_bookmark) if bookmarks else ends):
                await changed.wait()


########################################################################################################
# 4. The scheduler
#
# kube-scheduler's allocation of claims and of the extended resources DRA serves, on one node.
########################################################################################################

#: The extended resource name every DeviceClass answers to without extendedResourceName:
#: "deviceclass.resource.kubernetes.io/<class name>" (k8s.io/api resource/v1 types.go,
#: ResourceDeviceClassPrefix).
IMPLICIT_EXTENDED_RESOURCE_PREFIX = "deviceclass.resource.kubernetes.io/"

#: The annotation that marks the claim the scheduler makes for a pod's extended resources
#: (ExtendedResourceClaimAnnotation in k8s.io/api resource/v1 types.go).
EXTENDED_RESOURCE_CLAIM_ANNOTATION = "resource.kubernetes.io/extended-resource-claim"


class UnschedulableError(GopherplugError):
    """The simulated scheduler's verdict that a pod does not fit the node: it stays Pending, and
    the reason is its plugin's, as the pod's FailedScheduling event shows it."""


@dataclass
class Placement:
    """Where SchedulerSimulator put a pod's extended resources on its node."""

    node: str
    device_plugin: dict[str, int]  #: name -> count, left to the node's device plugin (noderesources fit)
    claim: dict[str, Any] | None  #: the claim made and allocated for the rest (DRA), as stored; None: none


class SchedulerSimulator:
    """A stand-in for kube-scheduler's decision about a pod's extended resources on one node
    (KEP-5004, extended resources served by DRA), following
    kubernetes/kubernetes pkg/scheduler/framework/plugins/dynamicresources/extendeddynamicresources.go:

    - each extended resource a container asks for (requests, or limits as the API server defaults
      requests from them) goes to DRA when a DeviceClass maps it (``spec.extendedResourceName``,
      or the implicit "deviceclass.resource.kubernetes.io/<class>") and the node's allocatable for
      it is 0 or absent; to the device plugin when the allocatable has it (the noderesources fit
      plugin then wants as many as asked: "Insufficient <name>"); neither: "cannot fit resource";
    - the names DRA serves become one ResourceClaim owned by the pod, generateName
      "<pod>-extended-resources-", annotated EXTENDED_RESOURCE_CLAIM_ANNOTATION, one request per
      container and name, "container-<i>-request-<j>" (i: the container's index, j: the name's
      index among the container's sorted request names), exactly that many devices of the class;
    - the claim is allocated from the node's ResourceSlices (newest generation of each pool,
      structured/pools.go) as the allocator does: a device the class's and the request's CEL
      selectors select (evaluated for real, with cel-python from the cel extra); not one already
      allocated to another claim, unless the request or that result has admin access; not one with
      a NoSchedule or NoExecute taint the request does not tolerate (allTaintsTolerated in
      k8s.io/dynamic-resource-allocation structured); too few: "cannot allocate all claims";
    - consumable capacity (KEP-5075) as the allocator has it with DRAConsumableCapacity on (see
      ``_consumes``): a device with ``allowMultipleAllocations: true`` is not taken by a claim but
      shared, each result a share with a fresh ``shareID`` and the ``consumedCapacity`` the
      request's ``capacity.requests`` round to by the requestPolicy; it goes to another request
      while the sums consumed stay within the values; CEL sees ``device.allowMultipleAllocations``
      and ``device.capacity`` (domain, then name: a quantity, with the quantity library's
      ``quantity()``, ``compareTo`` and the like; ``DeviceSelector``);
    - the claim is stored in ``api`` (ApiServerSimulator.put_claim), and the pod's
      status.extendedResourceClaimStatus names it with the request of each container and name
      (patchPodExtendedResourceClaimStatus).

    - a request with ``firstAvailable`` (a prioritized list, DRAPrioritizedList) gets its first
      subrequest that can be allocated, the result's request "<request>/<subrequest>"; the choice is
      greedy, request by request, where the allocator backtracks across a claim's requests;
    - as one release does (``version``, else the API server's): a device's taints count only
      with DRADeviceTaints on, allowMultipleAllocations and capacities only with
      DRAConsumableCapacity, extended resources go to DRA only with DRAExtendedResource, and
      adminAccess only with DRAAdminAccess.

    Init containers with extended resources are refused (ValueError): the scheduler's sharing of
    requests between them and the containers is not modelled; neither are other pods on the node.
    """

    def __init__(
        self,
        api: ApiServerSimulator,
        device_classes: Iterable[Mapping[str, Any]] | None = None,
        version: str | Release | None = None,
    ) -> None:
        self.api = api
        #: the release it speaks for: ``version``, else the API server's (one control plane)
        self.release = api.release if version is None else release(version)
        self._cel: dict[str, DeviceSelector] = {}  # expression -> compiled selector
        if device_classes is not None:
            self.device_classes = list(device_classes)

    @property
    def device_classes(self) -> list[dict[str, Any]]:
        """The DeviceClasses of the cluster, as the API server stored them. Set: the classes an admin
        applies (e.g. daemonset-dra.yaml's), in place of those there were, through the API server
        (which drops what its gates do not know)."""
        return list(self.api.device_classes.values())

    @device_classes.setter
    def device_classes(self, classes: Iterable[Mapping[str, Any]]) -> None:
        self.api.device_classes.clear()
        for device_class in classes:
            self.api.put_device_class(device_class)

    def device_class(self, resource_name: str) -> Mapping[str, Any] | None:
        """The DeviceClass that serves an extended resource name, explicitly or implicitly: none
        while DRAExtendedResource is off (the scheduler's DynamicResources plugin then leaves
        extended resources to the node's allocatable, pkg/scheduler/framework/plugins/dynamicresources)."""
        if not self.release.enabled("DRAExtendedResource"):
            return None
        for device_class in self.device_classes:
            implicit = IMPLICIT_EXTENDED_RESOURCE_PREFIX + device_class["metadata"]["name"]
            if resource_name in (device_class["spec"].get("extendedResourceName"), implicit):
                return device_class
        return None

    def schedule(self, pod: dict[str, Any], node: str) -> Placement:
        """Place ``pod`` (a Pod object: metadata with name, namespace and uid; spec.containers) on
        ``node``, or raise UnschedulableError. Writes spec.nodeName, and the claim's status into
        status.extendedResourceClaimStatus, into ``pod``, as the scheduler's bind and status patch do."""
        if any(_extended_requests(c) for c in pod["spec"].get("initContainers") or []):
            raise ValueError("SchedulerSimulator does not model init containers with extended resources")
        containers = pod["spec"]["containers"]
        asked: dict[str, int] = {}
        for container in containers:
            for name, count in _extended_requests(container).items():
                asked[name] = asked.get(name, 0) + count
        allocatable = ((self.api.nodes[node].get("status") or {}).get("allocatable")) or {}
        device_plugin, dra = {}, {}
        for name, count in sorted(asked.items()):
            has = int(allocatable.get(name, "0"))
            if self.device_class(name) is not None and has == 0:
                dra[name] = count
            elif name not in allocatable:
                raise UnschedulableError(f"cannot fit resource {name}")
            elif count > has:
                raise UnschedulableError(f"Insufficient {name}")
            else:
                device_plugin[name] = count
        claim = None
        if dra:
            claim = self._claim(pod, node, containers, dra)
        pod["spec"]["nodeName"] = node
        return Placement(node, device_plugin, claim)

    def _claim(
        self, pod: dict[str, Any], node: str, containers: list[dict[str, Any]], dra: dict[str, int]
    ) -> dict[str, Any]:
        metadata = pod["metadata"]
        requests: list[dict[str, Any]] = []
        mappings: list[dict[str, str]] = []
        for index, container in enumerate(containers):
            names = sorted(_container_requests(container))
            for name, count in sorted(_extended_requests(container).items()):
                if name not in dra:
                    continue
                device_class = self.device_class(name)
                assert device_class is not None
                request = f"container-{index}-request-{names.index(name)}"
                exactly = {"deviceClassName": device_class["metadata"]["name"], "allocationMode": "ExactCount"}
                requests.append({"name": request, "exactly": {**exactly, "count": count}})
                mappings.append({"containerName": container["name"], "resourceName": name, "requestName": request})
        requests.sort(key=lambda request: str(request["name"]))
        claim: dict[str, Any] = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {
                # generateName: the API server appends five random characters
                "name": f"{metadata['name']}-extended-resources-{uuid.uuid4().hex[:5]}",
                "namespace": metadata["namespace"],
                "uid": str(uuid.uuid4()),
                "annotations": {EXTENDED_RESOURCE_CLAIM_ANNOTATION: "true"},
                "ownerReferences": [
                    {"apiVersion": "v1", "kind": "Pod", "name": metadata["name"], "uid": metadata["uid"]}
                    | {"controller": True}
                ],
            },
            "spec": {"devices": {"requests": requests}},
        }
        claim["status"] = {"allocation": self.allocate(claim, node)}
        self.api.put_claim(claim)
        pod.setdefault("status", {})["extendedResourceClaimStatus"] = {
            "resourceClaimName": claim["metadata"]["name"],
            "requestMappings": mappings,
        }
        return claim

    def allocate(self, claim: Mapping[str, Any], node: str) -> dict[str, Any]:
        """The allocation of ``claim``'s requests on ``node`` as the allocator makes it (see the
        class), or UnschedulableError("cannot allocate all claims")."""
        # What the other claims hold (foreachAllocatedDevice in kubernetes/kubernetes
        # pkg/scheduler/framework/plugins/dynamicresources/allocateddevices.go): a result with admin
        # access holds nothing; one with a shareID holds its consumedCapacity of a shared device,
        # summed per device (AggregatedCapacity); any other result holds its device whole.
        in_use: set[tuple[str, str, str]] = set()
        consumed: dict[tuple[str, str, str], dict[str, Decimal]] = {}
        for other in self.api.claims.values():
            if other["metadata"]["uid"] == claim["metadata"]["uid"]:
                continue
            for result in (((other.get("status") or {}).get("allocation") or {}).get("devices") or {}).get(
                "results"
            ) or []:
                key = (result["driver"], result["pool"], result["device"])
                if result.get("adminAccess"):
                    continue
                if not result.get("shareID"):
                    in_use.add(key)
                    continue
                held = consumed.setdefault(key, {})
                for name, quantity in (result.get("consumedCapacity") or {}).items():
                    held[name] = held.get(name, Decimal(0)) + (_quantity(quantity) or Decimal(0))
        devices = self._node_devices(node)
        results: list[dict[str, Any]] = []
        for request in claim["spec"]["devices"]["requests"]:
            # A prioritized list (DRAPrioritizedList, KEP-4816): the first subrequest that can be
            # allocated, its result named "<request>/<subrequest>"; a plain request is its own one.
            if "firstAvailable" in request:
                if not self.release.enabled("DRAPrioritizedList"):
                    # The API server of such a cluster drops firstAvailable and then refuses the claim.
                    raise ValueError(f"request {request['name']}: firstAvailable needs DRAPrioritizedList")
                tries = [(f"{request['name']}/{sub['name']}", sub) for sub in request["firstAvailable"]]
            else:
                tries = [(request["name"], request["exactly"])]
            for name, exactly in tries:
                chosen = self._allocate_one(name, exactly, devices, in_use, consumed, results)
                if chosen is not None:
                    results += chosen
                    break
            else:
                raise UnschedulableError("cannot allocate all claims")
        selector = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
        return {"devices": {"results": results}, "nodeSelector": {"nodeSelectorTerms": [selector]}}

    def _allocate_one(
        self,
        name: str,
        exactly: Mapping[str, Any],
        devices: list[tuple[tuple[str, str, str], dict[str, Any], Any]],
        in_use: set[tuple[str, str, str]],
        consumed: Mapping[tuple[str, str, str], Mapping[str, Decimal]],
        results: list[dict[str, Any]],
    ) -> list[dict[str, Any]] | None:
        """The results of one request (or subrequest) ``name`` asking ``exactly``, given what other
        claims hold and this claim's earlier ``results``; None when the node cannot give it."""
        admin = bool(exactly.get("adminAccess")) and self.release.enabled("DRAAdminAccess")
        # Without their gates the allocator knows neither taints nor shared devices: the API server
        # dropped them (a slice written before the gate went off may still have them), and the
        # stable allocator, used while no alpha feature is on, has no code for them
        # (staging/src/k8s.io/dynamic-resource-allocation/structured/internal: stable, incubating).
        taints_count = self.release.enabled("DRADeviceTaints")
        consumable = self.release.enabled("DRAConsumableCapacity")
        asked = (exactly.get("capacity") or {}).get("requests") or {}
        device_class = self.api.device_classes.get(exactly["deviceClassName"])
        if device_class is None:
            raise UnschedulableError(f"request {name}: DeviceClass {exactly['deviceClassName']} not found")
        selectors = [*(device_class["spec"].get("selectors") or []), *(exactly.get("selectors") or [])]
        taken = {(r["driver"], r["pool"], r["device"]) for r in results}
        chosen: list[tuple[tuple[str, str, str], dict[str, str] | None]] = []
        for key, device, cel in devices:
            if len(chosen) == exactly.get("count", 1):
                break
            shared = consumable and device.get("allowMultipleAllocations") is True
            # A shared device is never in use, only full; one request still takes a device
            # once (allocateOne goes on from the next device), another request may take it again.
            if any(key == k for k, _ in chosen):
                continue
            if not shared and (key in taken or (key in in_use and not admin)):
                continue
            if not all(self._selects(selector["cel"]["expression"], cel) for selector in selectors):
                continue
            if taints_count and not _tolerates_all(exactly.get("tolerations") or [], device.get("taints") or []):
                continue
            wants = None
            if consumable:
                # Every device's capacity is checked, a shared one's against what the others hold
                # and what this claim's earlier results took of it (allocatingCapacity).
                already = dict(consumed.get(key) or {}) if shared else {}
                for result in results if shared else []:
                    if (result["driver"], result["pool"], result["device"]) == key:
                        for capacity, quantity in (result.get("consumedCapacity") or {}).items():
                            already[capacity] = already.get(capacity, Decimal(0)) + (_quantity(quantity) or Decimal(0))
                wants = _consumes(asked, device.get("capacity") or {}, already)
                if wants is None:
                    continue
            chosen.append((key, wants if shared else None))
        if len(chosen) < exactly.get("count", 1):
            return None
        made = []
        for (driver, pool, device_name), wants in chosen:
            result = {"request": name, "driver": driver, "pool": pool, "device": device_name}
            if wants is not None:
                # Each allocation of a shared device is a share of its own, named by a fresh
                # UUID (GenerateShareID, uuid.NewUUID: random, lower-case), with what it consumes.
                result["shareID"] = str(uuid.uuid4())
                result["consumedCapacity"] = wants
            made.append(result | ({"adminAccess": True} if admin else {}))
        return made

    def _node_devices(self, node: str) -> list[tuple[tuple[str, str, str], dict[str, Any], Any]]:
        """(driver, pool, device), the device, and the device as CEL sees it, of the node's slices
        of each pool's newest generation, in slice and device order."""
        slices = [item for item in self.api.slices.values() if item["spec"].get("nodeName") == node]
        newest: dict[tuple[str, str], int] = {}
        for item in slices:
            pool = (item["spec"]["driver"], item["spec"]["pool"]["name"])
            newest[pool] = max(newest.get(pool, 0), item["spec"]["pool"]["generation"])
        found = []
        for item in sorted(slices, key=lambda item: item["metadata"]["name"]):
            driver, pool = item["spec"]["driver"], item["spec"]["pool"]
            if pool["generation"] != newest[driver, pool["name"]]:
                continue
            for device in item["spec"].get("devices") or []:
                found.append(((driver, pool["name"], device["name"]), device, cel_device(driver, device)))
        return found

    def _selects(self, expression: str, device: Any) -> bool:
        if expression not in self._cel:
            self._cel[expression] = DeviceSelector(expression)
        try:
            return self._cel[expression].matches(device)
        except CELError as error:
            # The allocator fails the claim on a CEL runtime error; here the test learns why.
            raise UnschedulableError(f"CEL {expression!r}: {error}") from None


def _container_requests(container: Mapping[str, Any]) -> dict[str, Any]:
    """A container's resource requests: limits, then requests over them (the API server defaults
    requests from limits; an extended resource's must equal its limit)."""
    resources = container.get("resources") or {}
    return {**(resources.get("limits") or {}), **(resources.get("requests") or {})}


def _extended_requests(container: Mapping[str, Any]) -> dict[str, int]:
    """The extended resources a container asks for, more than 0 of each."""
    return {
        name: int(count)
        for name, count in _container_requests(container).items()
        if int(count) > 0
        and (name.startswith(IMPLICIT_EXTENDED_RESOURCE_PREFIX) or resource_name_problem(name) is None)
    }


def _consumes(
    asked: Mapping[str, Any], capacity: Mapping[str, Mapping[str, Any]], already: Mapping[str, Decimal]
) -> dict[str, str] | None:
    """What a request consumes of each capacity of a device, as the result's consumedCapacity
    writes it, or None when the device cannot give it (CmpRequestOverCapacity,
    calculateConsumedCapacity and violatesPolicy in kubernetes/kubernetes
    staging/src/k8s.io/dynamic-resource-allocation/structured/internal/incubating/consumable_capacity.go):

    - a request naming a capacity the device lacks: not this device (the allocator tries the next);
    - every capacity of the device is consumed, asked for or not: a capacity not asked for costs its
      requestPolicy's default, or, with none, the whole value (the device is then full);
    - an amount asked for is rounded up by the requestPolicy: to min, then to a whole step above min
      (validRange), or to the first of validValues not below it; with no requestPolicy it stays;
    - the rounded amount must keep to the policy (the default always does): not above max, whole
      steps from min, one of validValues; and, with ``already`` (what the other allocations hold),
      within the capacity's value.
    """
    if any(name not in capacity for name in asked):
        return None
    consumes = {}
    for name, held in capacity.items():
        value = _quantity(held.get("value")) or Decimal(0)
        policy = held.get("requestPolicy")
        if name not in asked:
            # A copy of a quantity keeps how it was written ("1Gi" stays "1Gi").
            text = str(held.get("value") if policy is None or "default" not in policy else policy["default"])
        else:
            text = _round_up(str(asked[name]), policy) if policy is not None else str(asked[name])
        amount = _quantity(text) or Decimal(0)
        if policy is not None and _violates(amount, policy):
            return None
        if already.get(name, Decimal(0)) + amount > value:
            return None
        consumes[name] = text
    return consumes


def _round_up(asked: str, policy: Mapping[str, Any]) -> str:
    """An amount asked for, rounded up by a requestPolicy (roundUpRange, roundUpValidValues): a
    bound or valid value as written, a step computed as a whole number in the binary-SI format
    (resource.NewQuantity(n, BinarySI): 2048 is "2Ki")."""
    amount = _quantity(asked) or Decimal(0)
    valid_range, values = policy.get("validRange"), policy.get("validValues")
    if valid_range is not None and "min" in valid_range:
        low = _quantity(valid_range["min"]) or Decimal(0)
        if amount < low:
            return str(valid_range["min"])
        step = _quantity(valid_range["step"]) if "step" in valid_range else None
        if not step:
            return asked
        whole = int(low + step * math.ceil((amount - low) / step))
        suffixes = ("Ki", "Mi", "Gi", "Ti", "Pi", "Ei")
        power = next((p for p in range(len(suffixes), 0, -1) if whole and whole % 1024**p == 0), 0)
        return f"{whole // 1024**power}{suffixes[power - 1]}" if power else str(whole)
    if values:
        return next((str(v) for v in values if amount <= (_quantity(v) or Decimal(0))), asked)
    return asked


def _violates(amount: Decimal, policy: Mapping[str, Any]) -> bool:
    """Whether a rounded amount breaks its requestPolicy (violatesPolicy, violateValidRange,
    violateValidValues): the default never does."""
    if "default" in policy and amount == _quantity(policy["default"]):
        return False
    valid_range, values = policy.get("validRange"), policy.get("validValues")
    if valid_range is not None:
        high = _quantity(valid_range["max"]) if "max" in valid_range else None
        if high is not None and amount > high:
            return True
        step = _quantity(valid_range["step"]) if "step" in valid_range else None
        low = _quantity(valid_range.get("min")) or Decimal(0)
        return step is not None and step != 0 and (amount - low) % step != 0
    if values:
        return amount not in [_quantity(v) for v in values]
    return False


def _tolerates_all(tolerations: list[Mapping[str, Any]], taints: list[Mapping[str, Any]]) -> bool:
    """Whether a request's tolerations tolerate every NoSchedule and NoExecute taint of a device
    (allTaintsTolerated in k8s.io/dynamic-resource-allocation structured; the matching rules of a
    toleration are a pod's: an empty key with Exists matches every taint, an empty effect every effect)."""

    def tolerates(toleration: Mapping[str, Any], taint: Mapping[str, Any]) -> bool:
        if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
            return False
        if toleration.get("key") and toleration["key"] != taint.get("key"):
            return False
        if toleration.get("operator", "Equal") == "Exists":
            return True
        return bool(toleration.get("value", "") == taint.get("value", ""))

    return all(
        any(tolerates(toleration, taint) for toleration in tolerations)
        for taint in taints
        if taint.get("effect") in ("NoSchedule", "NoExecute")
    )


########################################################################################################
# 5. The kubelet's DRA side, with extended resources
#
# What the kubelet does with the claim SchedulerSimulator made for a pod's extended resources.
########################################################################################################


class DraKubeletSimulator(gopherplug.DraKubeletSimulator):
    """gopherplug.DraKubeletSimulator (the plugin watcher and DRA manager: read its docstring
    first), with what the kubelet does for a pod whose extended resources DRA serves, as a kubelet of
    one release (``version``: "1.36" unless told, or a Release with an admin's gates; ``release``):

    - it opens the health stream (``watch_health``) only with ResourceHealthStatus on (alpha and off
      in 1.34 and 1.35): the DRA plugin manager starts NodeWatchResources only then
      (kubernetes/kubernetes pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go), so a kubelet without
      it never calls, and ``watch_health`` raises RPCError FAILED_PRECONDITION saying so;
    - it speaks DRAResourceHealth v1alpha1 alone up to 1.36 and, from 1.37, v1, v1beta1 and
      v1alpha1, the first the driver lists (unless ``health_versions`` is given).
    """

    def __init__(
        self, *args: Any, version: str | Release = "1.36", info_interval: float | None = None, **options: Any
    ) -> None:
        self.release = release(version)
        if "health_versions" not in options and _minor(self.release.version) >= 37:
            options["health_versions"] = [name for name, _ in gopherplug.DRA_HEALTH_VERSIONS]
        super().__init__(*args, **options)
        #: how often GetInfo is called again on each registered driver (the newest plugin watcher:
        #: every 10 s; None: only to register, as kubelets up to 1.36 do)
        self.info_interval = info_interval

    async def _follow(self, watch: Any) -> None:
        async with trio.open_nursery() as nursery:  # from each start, as the plugin watcher's loop
            if self.info_interval is not None:
                nursery.start_soon(self._ask_again, self.info_interval)
            await super()._follow(watch)
            nursery.cancel_scope.cancel()

    async def _ask_again(self, interval: float) -> None:
        """GetInfo on every registered driver every ``interval`` seconds: the plugin watcher's check
        that a plugin it registered is still there (its answer is not looked at here)."""
        while True:
            await trio.sleep(interval)
            for driver in [plugin for plugins in self.plugins.values() for plugin in plugins]:
                with contextlib.suppress(RPCError):
                    request = gopherplug.pluginregistration.InfoRequest()
                    path = driver.registration_socket
                    await gopherplug.call_unary(
                        path,
                        gopherplug.DRA_METHODS[gopherplug.GET_INFO],
                        request,
                        timeout=gopherplug.DRA_GET_INFO_TIMEOUT,
                    )
                    self.events.append(("asked", path))
                    self._changed.touch()

    def cdi_devices(self, claim_uid: str, request: str = "") -> list[str]:
        """The CDI device IDs the kubelet gives a container whose resources.claims[] entry names this
        claim and ``request`` ("": the whole claim): those of every driver's devices whose request
        names contain ``request`` exactly, or that name no request (cdiDevicesAsList in
        pkg/kubelet/cm/dra/claiminfo.go). A name the container cannot spell ("gpu/fast") matches none."""
        return [
            cdi_id
            for devices in self.prepared.get(claim_uid, {}).values()
            for device in devices
            if not request or not device.request_names or request in device.request_names
            for cdi_id in device.cdi_device_ids
        ]

    def drop(self, driver: str) -> None:
        """Forget a registered driver without a word to it, its socket still there, as a kubelet does
        that lost track of it: no more GetInfo, no more calls."""
        for dropped in self.plugins.pop(driver):
            dropped.connection.cancel()
            self.events.append(("dropped", dropped.registration_socket))
        self._sync(driver)
        self._changed.touch()

    @contextlib.asynccontextmanager
    async def watch_health(self, driver: str) -> AsyncIterator[AsyncIterator[Any]]:
        if not self.release.enabled("ResourceHealthStatus"):
            raise RPCError(
                StatusCode.FAILED_PRECONDITION,
                f"a kubelet {self.release.git_version} with ResourceHealthStatus off never opens NodeWatchResources",
            )
        async with super().watch_health(driver) as responses:
            yield responses

    async def prepare_extended_resources(self, pod: Mapping[str, Any], claim: Mapping[str, Any]) -> None:
        """Prepare the claim the scheduler made for ``pod``'s extended resources (the one its
        status.extendedResourceClaimStatus names), as the kubelet's DRA manager prepares a pod's
        claims before its containers start: NodePrepareResources to each driver of its results
        (PrepareResources in kubernetes/kubernetes pkg/kubelet/cm/dra/manager.go). Raises
        ClaimError with the driver's error for the claim, which fails the pod's start."""
        status = pod["status"]["extendedResourceClaimStatus"]
        metadata = claim["metadata"]
        if metadata["name"] != status["resourceClaimName"]:
            raise ValueError(f"pod {pod['metadata']['name']} names claim {status['resourceClaimName']}")
        results = claim["status"]["allocation"]["devices"]["results"]
        for driver in sorted({result["driver"] for result in results}):
            response = await self.prepare(driver, [(metadata["namespace"], metadata["uid"], metadata["name"])])
            if error := response.claims[metadata["uid"]].error:
                raise ClaimError(error)

    def extended_resource_cdi_devices(
        self, pod: Mapping[str, Any], claim: Mapping[str, Any], container_name: str
    ) -> list[str]:
        """The CDI device IDs a container of ``pod`` gets for the extended resources DRA serves it:
        for each such name it asks for, the prepared devices of every request the pod's
        extendedResourceClaimStatus maps that container and name to (GetResources in
        kubernetes/kubernetes pkg/kubelet/cm/dra/manager.go; cdi_devices per request)."""
        (container,) = [c for c in pod["spec"]["containers"] if c["name"] == container_name]
        mappings = pod["status"]["extendedResourceClaimStatus"]["requestMappings"]
        return [
            cdi_id
            for name in _extended_requests(container)
            for mapping in mappings
            if mapping["containerName"] == container_name and mapping["resourceName"] == name
            for cdi_id in self.cdi_devices(claim["metadata"]["uid"], mapping["requestName"])
        ]


########################################################################################################
# 6. The kubelet's PodResources API, rate-limited
#
# gopherplug.PodResourcesSimulator answers from the kubelet stand-ins' books; this one refuses as
# the kubelet does when its clients call too often.
########################################################################################################

#: The kubelet's limit on its PodResources socket: 100 calls a second, bursts of 10, all clients
#: together (DefaultQPS, DefaultBurstTokens in kubernetes/kubernetes pkg/kubelet/apis/podresources/constants.go).
POD_RESOURCES_QPS, POD_RESOURCES_BURST = 100.0, 10


class PodResourcesSimulator(gopherplug.PodResourcesSimulator):
    """gopherplug.PodResourcesSimulator (read its docstring first) with the kubelet's rate limit: a
    token bucket of ``qps`` tokens a second and ``burst`` at most, a call without a token refused at
    once with RESOURCE_EXHAUSTED "rejected by rate limit" (LimiterUnaryServerInterceptor in
    kubernetes/kubernetes pkg/kubelet/apis/grpc/ratelimit.go: golang.org/x/time/rate's Allow, no
    waiting). ``refused`` counts the calls refused."""

    def __init__(
        self,
        socket_path: str,
        kubelet: gopherplug.KubeletSimulator | None = None,
        dra_kubelet: gopherplug.DraKubeletSimulator | None = None,
        *,
        qps: float = POD_RESOURCES_QPS,
        burst: int = POD_RESOURCES_BURST,
    ) -> None:
        super().__init__(socket_path, kubelet, dra_kubelet)
        self.qps, self.burst = qps, burst
        self.refused = 0
        self._tokens = float(burst)
        self._last: float | None = None  # when a token was last taken (trio's clock)

    async def _admit(self, method: str) -> None:
        now = trio.current_time()
        if self._last is not None:
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.qps)
        self._last = now
        if self._tokens < 1:
            self.refused += 1
            raise RPCError(StatusCode.RESOURCE_EXHAUSTED, "rejected by rate limit")
        self._tokens -= 1


########################################################################################################
# 7. The container runtime's CDI injection
#
# What reaches a container through CDI is decided by the runtime, from the spec files on the node: a
# test asks what the container's env would be, not what gopherplug meant it to be. The runtime tier
# (test_runtime.py) shows the same on a real containerd.
########################################################################################################


class CDIInjectionError(Exception):
    """The runtime refuses to create the container: a CDI device it was given resolves to no device."""


def cdi_container_env(spec_dirs: Iterable[str], cdi_ids: Iterable[str], env: Iterable[str] = ()) -> list[str]:
    """The env of a container created with ``cdi_ids`` (as the kubelet passes them, in its order)
    over its own ``env`` ("NAME=value" each: the image's and the pod's), as containerd gives it:

    - the specs are every ``*.json`` and ``*.yaml`` file of ``spec_dirs``, later directories of
      higher priority; a device named in two files of one directory is a conflict and resolves to
      nothing, one named in two directories is the later's (Cache.refresh in
      cncf-tags/container-device-interface pkg/cdi/cache.go); another file (a ``.tmp`` being
      written) is not read;
    - an ID given twice counts once (WithCDI in containerd's CRI plugin); one that resolves to no
      device fails the container's creation ("unresolvable CDI devices ...", Cache.InjectDevices);
    - a spec's own containerEdits apply before the first of its devices given, then each device's,
      in order; a variable set again keeps its place and takes the new value, so the last value
      wins (AddMultipleProcessEnv in internal/ociedit/spec_editor.go, runtime-tools' generate before
      it): a CDI device also overrides the pod's own env of that name."""
    import yaml

    devices: dict[str, tuple[int, str, dict[str, Any]]] = {}  # kind=name -> (priority, file, edits)
    specs: dict[str, dict[str, Any]] = {}  # file -> its spec's containerEdits
    conflicts: set[str] = set()
    for priority, directory in enumerate(spec_dirs):
        try:
            names = sorted(os.listdir(directory))
        except FileNotFoundError:
            continue
        for name in names:
            if not name.endswith((".json", ".yaml")):
                continue
            path = os.path.join(directory, name)
            with open(path, encoding="utf-8") as file:
                spec = json.load(file) if name.endswith(".json") else yaml.safe_load(file)
            specs[path] = spec.get("containerEdits") or {}
            for device in spec["devices"]:
                qualified = f"{spec['kind']}={device['name']}"
                if qualified in devices and devices[qualified][0] == priority:
                    conflicts.add(qualified)
                devices[qualified] = (priority, path, device["containerEdits"])
    applied = list(env)
    places = {variable.partition("=")[0]: index for index, variable in enumerate(applied)}

    def apply(edits: Mapping[str, Any]) -> None:
        for variable in edits.get("env") or ():
            key = variable.partition("=")[0]
            if key in places:
                applied[places[key]] = variable
            else:
                places[key] = len(applied)
                applied.append(variable)

    wanted = list(dict.fromkeys(cdi_ids))
    unresolved = [cdi_id for cdi_id in wanted if cdi_id not in devices or cdi_id in conflicts]
    if unresolved:
        raise CDIInjectionError(f"unresolvable CDI devices {', '.join(unresolved)}")
    seen_specs: set[str] = set()
    for cdi_id in wanted:
        _, path, edits = devices[cdi_id]
        if path not in seen_specs:
            seen_specs.add(path)
            apply(specs[path])
        apply(edits)
    return applied
