"""DRA: ResourceSlices, claims, the kubelet's DRA side and the API server."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
import re
import socket
import sys
from pathlib import Path

import pytest
import trio
import trio.socket
import trio.testing
import yaml
from google.protobuf import descriptor_pb2
from grpc_tools import protoc
from hypothesis import given, settings
from hypothesis import strategies as st

import gopherplug as gp
import gopherplug_standins as standins
from testsupport import (
    DRIVER,
    HERE,
    MINIMAL,
    NODE_UID,
    POD_UID,
    RESOURCE,
    SHARE_1,
    TIMEOUT,
    DraNode,
    check,
    claim,
    config_with,
    described_calls,
    dra_config,
    resource_in,
    resources,
    run_cli,
    usb_nodes,
    usb_tree,
)

BAD_CONFIGS = [
    *(
        (empty, "cfg.yaml: is empty: it needs resources, a list of the devices to offer (docs/configuration.md)")
        for empty in ("", "# only a comment\n", "---\n")
    ),
    ("- a\n- b\n", "cfg.yaml: must be a mapping of keys to values, not a list: a key of a mapping takes no '- '"),
    ("{}", "cfg.yaml: resources: is required"),
    ("resources: []", "cfg.yaml: resources: must be a non-empty list of resources"),
    ("resources: {}", "cfg.yaml: resources: must be a non-empty list of resources"),
    ("resources: [x]", "cfg.yaml: resources[0]: must be a mapping of keys to values"),
    (
        MINIMAL + "extra: 1\n",
        "cfg.yaml: extra: unknown key; expected one of "
        "dev_root, device_plugin_dir, dra, health_address, metrics_address, nfd_features_file, resources, sysfs_root",
    ),
    (
        MINIMAL + "device_plugins_dir: /var/lib/kubelet/device-plugins\n",
        "cfg.yaml: device_plugins_dir: unknown key; did you mean device_plugin_dir? expected one of "
        "dev_root, device_plugin_dir, dra, health_address, metrics_address, nfd_features_file, resources, sysfs_root",
    ),
    (
        resources(pattren="ttyUSB*"),
        "cfg.yaml: resources[0].pattren: unknown key; did you mean pattern? expected one of allow_mounted, "
        "allowed_host_paths, annotations, api, attributes, capacity, cdi, describe, device_specs, directory, env, "
        "id_pattern, match, mounts, name, pattern, pre_start, pre_start_timeout, preferred, replicas, shared_with, "
        "usb, whole_dev",
    ),
    # A glob written bare begins with "*", which YAML reads as an alias (a syntax error, or an
    # undefined one): the line says to quote it, with the quoted key and value to write.
    *(
        (
            f"resources:\n  - name: example.com/g\n    directory: /dev\n    pattern: {glob}\n",
            f"cfg.yaml: invalid YAML at line 4, column 14: '{glob}' is read by YAML as an alias (a reference to an "
            f'&anchor): put it in quotes, pattern: "{glob}" (PyYAML at line 4, {said})',
        )
        for glob, said in (
            ("*", "column 15: expected alphabetic or numeric character, but found '\\n'"),
            ("*.sock", "column 15: expected alphabetic or numeric character, but found '.'"),
            ("*USB0", "column 14: found undefined alias 'USB0'"),
        )
    ),
    (
        "resources: [{name: example.com/g, match: [{directory: /dev, pattern: *}]}]",
        "cfg.yaml: invalid YAML at line 1, column 70: '*' is read by YAML as an alias (a reference to an &anchor): "
        'put it in quotes, pattern: "*" (PyYAML at line 1, column 71: expected alphabetic or numeric character, '
        "but found '}')",
    ),
    # directory (or match) and usb in one resource gave the union of both, silently.
    *(
        (
            yaml.safe_dump(
                {"resources": [{"name": "example.com/g", **sources, "usb": [{"vendor": "1a86", "product": "7523"}]}]}
            ),
            f"cfg.yaml: resources[0].usb: and {key} in one resource would offer both kinds of device as one list: "
            "give the USB devices a resource of their own",
        )
        for key, sources in (
            ("directory", {"directory": "/dev", "pattern": "ttyUSB*"}),
            ("match", {"match": [{"directory": "/dev", "pattern": "ttyUSB*"}]}),
        )
    ),
    (
        resources(shared_with=["example.com/other"]),
        "cfg.yaml: resources[0].shared_with[0]: 'example.com/other' names no resource of this file: list the "
        "resources that may offer the same device nodes as this one",
    ),
    (
        resources(shared_with=["example.com/gopher"]),
        "cfg.yaml: resources[0].shared_with[0]: 'example.com/gopher' is this resource itself: list the resources "
        "that may offer the same device nodes as this one",
    ),
    (resources(shared_with="example.com/x"), "cfg.yaml: resources[0].shared_with: must be a list"),
    (MINIMAL + "sysfs_root: sys\n", "cfg.yaml: sysfs_root: 'sys' must be an absolute path"),
    (  # found by hypothesis: a key with a newline made a two-line message
        yaml.safe_dump({"resources": [], "a\nb": 1}),
        "cfg.yaml: a\\nb: unknown key; expected one of "
        "dev_root, device_plugin_dir, dra, health_address, metrics_address, nfd_features_file, resources, sysfs_root",
    ),
    (MINIMAL + "device_plugin_dir: dp\n", "cfg.yaml: device_plugin_dir: 'dp' must be an absolute path"),
    ("resources: [{directory: /g}]", "cfg.yaml: resources[0].name: is required"),
    (
        "resources: [{name: example.com/g}]",
        "cfg.yaml: resources[0].directory: is required, unless match or usb says where the devices are",
    ),
    (resources(directory="gophers"), "cfg.yaml: resources[0].directory: 'gophers' must be an absolute path"),
    (resources(directory=7), "cfg.yaml: resources[0].directory: must be a non-empty string, not 7 (put it in quotes)"),
    (resources(directory=[]), "cfg.yaml: resources[0].directory: must be a non-empty string"),
    (
        resources(pre_start=[True]),
        "cfg.yaml: resources[0].pre_start[0]: must be a non-empty string, not True (put it in quotes)",
    ),
    (
        resources(colour="blue"),
        "cfg.yaml: resources[0].colour: unknown key; expected one of allow_mounted, allowed_host_paths, "
        "annotations, api, attributes, capacity, cdi, describe, device_specs, directory, env, id_pattern, match, "
        "mounts, name, pattern, pre_start, pre_start_timeout, preferred, replicas, shared_with, usb, whole_dev",
    ),
    (resources(pattern=""), "cfg.yaml: resources[0].pattern: must be a non-empty string"),
    (
        yaml.safe_dump({"device_plugin_dir": "/" + "d" * 70, "resources": [{"name": "e.com/g", "directory": "/g"}]}),
        f"cfg.yaml: device_plugin_dir: '/{'d' * 70}' is 71 characters long: a socket path in it would pass the "
        "107 bytes unix sockets allow; use a directory of at most 69 characters",
    ),
    (resources(env="1GOPHER"), "cfg.yaml: resources[0].env: '1GOPHER' is not a valid environment variable name"),
    (resources(env="GO-PHER"), "cfg.yaml: resources[0].env: 'GO-PHER' is not a valid environment variable name"),
    *(
        (
            resources(env=name),
            f"cfg.yaml: resources[0].env: {name!r} is given meaning by the shell or the dynamic loader: "
            "choose another name",
        )
        for name in ("PATH", "LD_PRELOAD")
    ),
    (
        resources(env="GOPHERPLUG_RESOURCE"),
        "cfg.yaml: resources[0].env: 'GOPHERPLUG_RESOURCE' is set by gopherplug for pre_start: choose another name",
    ),
    (
        resources(device_specs={"a": 1}),
        "cfg.yaml: resources[0].device_specs: must be a list",
    ),
    (
        resources(device_specs=[{"container_path": "/dev/x"}]),
        "cfg.yaml: resources[0].device_specs[0].host_path: is required",
    ),
    (
        resources(device_specs=[{"host_path": "dev/{id}", "container_path": "/dev/x"}]),
        "cfg.yaml: resources[0].device_specs[0].host_path: 'dev/{id}' must be an absolute path",
    ),
    (
        resources(device_specs=[{"host_path": "/dev/{nom}", "container_path": "/dev/x"}]),
        "cfg.yaml: resources[0].device_specs[0].host_path: '/dev/{nom}': bad placeholder ('nom'); "
        "use {id}, {path}, {name}, {target} or {index}",
    ),
    (
        resources(device_specs=[{"host_path": "/g/x", "container_path": "/dev/x", "permissions": "rx"}]),
        "cfg.yaml: resources[0].device_specs[0].permissions: 'rx': use letters from r, w and m, each once",
    ),
    (
        resources(device_specs=[{"host_path": "/dev/g{index}", "container_path": "/dev/x"}]),
        "cfg.yaml: resources[0].device_specs[0].host_path: '/dev/g{index}': a host path can use {id}, {path}, "
        "{name} and {target}, not {index}",
    ),
    (
        resources(device_specs=[{"host_path": "/etc/shadow", "container_path": "/dev/x"}]),
        "cfg.yaml: resources[0].device_specs[0].host_path: '/etc/shadow' is outside /g: add its directory "
        "to allowed_host_paths",
    ),
    (
        resources(directory="/dev/serial/by-id", device_specs=[{"host_path": "/etc/shadow", "container_path": "/x"}]),
        "cfg.yaml: resources[0].device_specs[0].host_path: '/etc/shadow' is outside /dev/serial/by-id, /dev: add "
        "its directory to allowed_host_paths",
    ),
    (
        resources(mounts=[{"host_path": "/dev/../etc", "container_path": "/etc"}]),
        "cfg.yaml: resources[0].mounts[0].host_path: '/dev/../etc' is outside /g: add its directory "
        "to allowed_host_paths",
    ),
    (
        resources(mounts=[{"host_path": "/g/{id}", "container_path": "/x", "read_only": "yes"}]),
        "cfg.yaml: resources[0].mounts[0].read_only: 'yes': must be true or false",
    ),
    (
        resources(mounts=[{"host_path": "/g/{id}", "container_path": "x"}]),
        "cfg.yaml: resources[0].mounts[0].container_path: 'x' must be an absolute path",
    ),
    (
        resources(allowed_host_paths=["/"]),
        "cfg.yaml: resources[0].allowed_host_paths[0]: '/' would allow every host path: list the directories you need",
    ),
    (resources(allowed_host_paths="/opt"), "cfg.yaml: resources[0].allowed_host_paths: must be a list"),
    (
        resources(annotations={"example.com/a b": "x"}),
        "cfg.yaml: resources[0].annotations.example.com/a b: not a valid annotation key: [prefix/]name, a name of "
        "at most 63 letters, digits, '-', '_', '.'",
    ),
    (
        resources(annotations={"example.com/{path}": "x"}),
        "cfg.yaml: resources[0].annotations.example.com/{path}: a key can use {id} and {index}, not a path or name",
    ),
    (
        resources(annotations={"example.com/n": 3}),
        "cfg.yaml: resources[0].annotations.example.com/n: 3: must be a string (quote it)",
    ),
    (
        resources(annotations={"example.com/n": "{nope}"}),
        "cfg.yaml: resources[0].annotations.example.com/n: '{nope}': bad placeholder ('nope'); "
        "use {id}, {path}, {name}, {target} or {index}",
    ),
    (resources(replicas=0), "cfg.yaml: resources[0].replicas: 0: must be a whole number from 1 to 1000"),
    (resources(replicas=True), "cfg.yaml: resources[0].replicas: True: must be a whole number from 1 to 1000"),
    (resources(replicas=2.5), "cfg.yaml: resources[0].replicas: 2.5: must be a whole number from 1 to 1000"),
    (  # YAML 1.1 octal: PyYAML reads 010 as 8, which no one means
        "resources: [{name: example.com/g, directory: /g, replicas: 010}]",
        "cfg.yaml: resources[0].replicas: 010 is read by YAML as an octal number, 8: write 8 if you meant that, "
        "or 10 without the leading zero",
    ),
    (  # YAML 1.2: a mapping's keys are unique; PyYAML keeps the last, which would offer other devices
        "resources:\n  - name: example.com/coral\n    directory: /dev\n    pattern: apex_*\n    pattern: hailo*\n",
        "cfg.yaml: key 'pattern' is written twice in one mapping, on lines 4 and 5: keep one",
    ),
    (resources(preferred="dense"), "cfg.yaml: resources[0].preferred: 'dense': must be packed or spread"),
    (resources(cdi={}), "cfg.yaml: resources[0].cdi.kind: is required"),
    (
        yaml.safe_dump(
            {
                "resources": [
                    {"name": "example.com/a", "directory": "/a", "cdi": {"kind": "a.b/c-dd"}},
                    {"name": "example.com/b", "directory": "/b", "cdi": {"kind": "a.b-c/dd"}},
                ]
            }
        ),
        "cfg.yaml: resources[1].cdi.kind: 'a.b-c/dd' would share the CDI spec file /var/run/cdi/a.b-c-dd.json with "
        "resources[0]: give each resource its own kind",
    ),
    (
        resources(cdi={"kind": "gopher"}),
        "cfg.yaml: resources[0].cdi.kind: 'gopher': must be vendor/class, e.g. example.com/gopher "
        "(a DNS name, then 2 to 63 of A-Z a-z 0-9 _ . -; each beginning with a letter)",
    ),
    (
        resources(cdi={"kind": "example.com/gopher"}, env="LD"),
        "cfg.yaml: resources[0].env: 'LD': with cdi, each device sets LD_<ID>, which could name a variable the "
        "shell or the dynamic loader give meaning to: choose another name",
    ),
    (
        resources(cdi={"kind": "a" * 190 + ".com/" + "b" * 60}),
        f"cfg.yaml: resources[0].cdi.kind: '{'a' * 190}.com/{'b' * 60}' is too long to name a file after: at most "
        "244 characters",
    ),
    (
        resources(cdi={"kind": "example.com/3d"}),  # CDI wants a letter first, where Kubernetes does not
        "cfg.yaml: resources[0].cdi.kind: 'example.com/3d': must be vendor/class, e.g. example.com/gopher "
        "(a DNS name, then 2 to 63 of A-Z a-z 0-9 _ . -; each beginning with a letter)",
    ),
    (
        resources(cdi={"kind": "example.com/a"}),  # CDI v1.1.0 panics on it (container-device-interface#320)
        "cfg.yaml: resources[0].cdi.kind: 'example.com/a': a one-character vendor or class crashes containerd 2.x "
        "at every start (its CDI library v1.1.0 panics on such a spec file): use 2 characters or more",
    ),
    (
        resources(cdi={"kind": "example.com/gopher", "spec_dir": "cdi"}),
        "cfg.yaml: resources[0].cdi.spec_dir: 'cdi' must be an absolute path",
    ),
    (
        resources(
            cdi={"kind": "example.com/gopher"},
            device_specs=[{"host_path": "/dev/{id}", "container_path": "/dev/g{index}"}],
        ),
        "cfg.yaml: resources[0].device_specs[0].container_path: '/dev/g{index}': with cdi, a device is described "
        "once, not per allocation: use {id} instead of {index}",
    ),
    (
        resources(pre_start=[]),
        "cfg.yaml: resources[0].pre_start: must be a non-empty list: the program, then its arguments (no shell)",
    ),
    (resources(pre_start="true"), "cfg.yaml: resources[0].pre_start: must be a list"),
    (
        resources(pre_start=["no-such-program-here"]),
        "cfg.yaml: resources[0].pre_start[0]: 'no-such-program-here' is not an executable file here or on PATH",
    ),
    (
        resources(pre_start=["true"], pre_start_timeout=30),
        "cfg.yaml: resources[0].pre_start_timeout: 30: must be a number of seconds, more than 0 and less than "
        "the kubelet's 30",
    ),
    (
        yaml.safe_dump({"resources": [{"name": "example.com/g", "directory": "/a"}] * 2}),
        "cfg.yaml: resources[1].name: example.com/g is already used by resources[0]",
    ),
    (  # Allocate sets it: a container given a Coral and a Hailo would see one list, the other overwritten
        "resources: [{name: example.com/coral, directory: /dev/apex, env: ACCEL}, "
        "{name: example.com/hailo, directory: /dev/hailo, env: ACCEL}]",
        "cfg.yaml: resources[1].env: ACCEL is also the env of example.com/coral (resources[0]): a container given "
        "devices of both would see one list; set another env on example.com/hailo, or shared_with if both offer the "
        "same devices",
    ),
    ("resources: [", "cfg.yaml: invalid YAML (line 1, column 13: expected the node content, but found '<stream end>')"),
    # generic-device-plugin's configuration, carried over: its keys point to docs/generic-device-plugin.md.
    (
        "devices:\n  - name: fuse\n    groups:\n      - count: 10\n        paths:\n          - path: /dev/fuse\n",
        "cfg.yaml: devices: is generic-device-plugin's, not gopherplug's: gopherplug's configuration lists resources "
        "instead, one for each of its devices "
        "(docs/generic-device-plugin.md translates each of its keys)",
    ),
    (  # one --device document
        "name: serial\ngroups:\n  - paths:\n      - path: /dev/ttyUSB*\n",
        "cfg.yaml: groups: is generic-device-plugin's, not gopherplug's: a resource here has directory and pattern, "
        "match or usb instead, and replicas for count "
        "(docs/generic-device-plugin.md translates each of its keys)",
    ),
    (  # ... in a resource
        resources(groups=[{"count": 10, "paths": [{"path": "/dev/fuse"}]}]),
        "cfg.yaml: resources[0].groups: is generic-device-plugin's, not gopherplug's: a resource here has directory "
        "and pattern, match or usb instead, and replicas for count "
        "(docs/generic-device-plugin.md translates each of its keys)",
    ),
    (
        resources(paths=[{"path": "/dev/ttyUSB*"}]),
        "cfg.yaml: resources[0].paths: is generic-device-plugin's, not gopherplug's: a resource here has directory "
        "and pattern instead, a glob of the entries of one directory "
        "(docs/generic-device-plugin.md translates each of its keys)",
    ),
    # The common YAML mistakes, told in a sentence at the line where they are, PyYAML's words after it.
    (  # a key indented more than its neighbours
        "resources:\n  - name: example.com/gopher\n    directory: /dev/g\n     pattern: 'g*'\n",
        "cfg.yaml: invalid YAML at line 4, column 6: this line is indented by 5 spaces, unlike the lines above it: "
        "indent it as far as 'directory' on line 3 (4 spaces) "
        "(PyYAML at line 4, column 13: mapping values are not allowed here)",
    ),
    (  # ... less: PyYAML's "expected <block end>, but found '<block mapping start>'"
        "resources:\n  - name: example.com/gopher\n    directory: /dev/g\n   pattern: 'g*'\n",
        "cfg.yaml: invalid YAML at line 4, column 4: this line is indented by 3 spaces, unlike the lines above it: "
        "indent it as far as 'directory' on line 3 (4 spaces) "
        "(PyYAML at line 4, column 4: expected <block end>, but found '<block mapping start>')",
    ),
    (  # ... as far as the list's "- ", without one
        "resources:\n  - name: example.com/gopher\n  directory: /dev/g\n",
        "cfg.yaml: invalid YAML at line 3, column 3: this line is indented by 2 spaces, unlike the lines above it: "
        "indent it as far as 'name' on line 2 (4 spaces) "
        "(PyYAML at line 3, column 3: expected <block end>, but found '?')",
    ),
    (  # a top-level key indented
        "device_plugin_dir: /dp\n  resources:\n  - name: example.com/gopher\n",
        "cfg.yaml: invalid YAML at line 2, column 3: this line is indented by 2 spaces, unlike the lines above it: "
        "indent it as far as 'device_plugin_dir' on line 1 (0 spaces) "
        "(PyYAML at line 2, column 12: mapping values are not allowed here)",
    ),
    (  # a tab to indent
        "resources:\n  - name: example.com/gopher\n\tdirectory: /dev/g\n",
        "cfg.yaml: invalid YAML at line 3, column 1: a tab: YAML takes only spaces, to indent and after a key's colon: "
        "replace it with spaces (PyYAML at line 3, column 1: found character '\\t' that cannot start any token)",
    ),
    (  # a tab after a colon
        "resources:\n  - name: example.com/gopher\n    directory:\t/dev/g\n",
        "cfg.yaml: invalid YAML at line 3, column 15: a tab: YAML takes only spaces, to indent and after a key's "
        "colon: replace it with spaces "
        "(PyYAML at line 3, column 15: found character '\\t' that cannot start any token)",
    ),
    (  # no space after a colon: PyYAML finds out at the next key, a line below
        "resources:\n  - name:example.com/gopher\n    directory: /dev/g\n",
        "cfg.yaml: invalid YAML at line 2, column 9: a key needs a space after its colon: write "
        "'name: example.com/gopher' (PyYAML at line 3, column 14: mapping values are not allowed here)",
    ),
    (  # ... or at the end of the text
        "resources:\n  - name: example.com/gopher\n    directory:/dev/g\n",
        "cfg.yaml: invalid YAML at line 3, column 14: a key needs a space after its colon: write 'directory: /dev/g' "
        "(PyYAML at line 4, column 1: could not find expected ':')",
    ),
    (  # ... or not at all: valid YAML, a string where a mapping belongs
        "resources:\n  - name:example.com/gopher\n",
        "cfg.yaml: resources[0]: must be a mapping of keys to values: write name: example.com/gopher, with a space "
        "after the colon ('name:example.com/gopher' is one word to YAML)",
    ),
    (  # a list item where a mapping was expected
        "resources:\n  - name: example.com/gopher\n    directory: /dev/g\n    - pattern: 'g*'\n",
        "cfg.yaml: invalid YAML at line 4, column 5: a list item ('- ') among the keys of a mapping (key: value): "
        "remove its '- ', or begin the mapping's first key with '- ' too, for a list of mappings "
        "(PyYAML at line 4, column 5: expected <block end>, but found '-')",
    ),
    (  # ... the first key without its "- "
        "resources:\n  name: example.com/gopher\n  - directory: /dev/g\n",
        "cfg.yaml: invalid YAML at line 3, column 3: a list item ('- ') among the keys of a mapping (key: value): "
        "remove its '- ', or begin the mapping's first key with '- ' too, for a list of mappings "
        "(PyYAML at line 3, column 3: expected <block end>, but found '-')",
    ),
    (  # ... valid YAML: a list where a mapping belongs
        "resources:\n  - name: example.com/gopher\n    directory: /dev/g\n    cdi:\n      - kind: example.com/gopher\n",
        "cfg.yaml: resources[0].cdi: must be a mapping of keys to values, not a list: a key of a mapping takes no '- '",
    ),
    (  # not one of the common mistakes: PyYAML's words alone, not a wrong guess
        "resources:\n  - name: example.com/gopher\n    directory: /dev/g: x\n",
        "cfg.yaml: invalid YAML (line 3, column 22: mapping values are not allowed here)",
    ),
    (
        resources(name="gopher"),
        "cfg.yaml: resources[0].name: 'gopher': must be an extended resource name, domain/name "
        "(e.g. example.com/gopher)",
    ),
    # Several sources, IDs from names, USB devices.
    (
        resources(match=[{"directory": "/h"}]),
        "cfg.yaml: resources[0].directory: goes in a match entry when match is given "
        "(directory and pattern are a match of one)",
    ),
    (
        "resources: [{name: example.com/g, pattern: 'g*'}]",
        "cfg.yaml: resources[0].pattern: names entries of a directory: give directory too",
    ),
    (
        "resources: [{name: example.com/g, match: []}]",
        "cfg.yaml: resources[0].match: must list at least one {directory, pattern}",
    ),
    (
        "resources: [{name: example.com/g, match: [{pattern: 'g*'}]}]",
        "cfg.yaml: resources[0].match[0].directory: is required",
    ),
    (
        "resources: [{name: example.com/g, match: [{directory: g}]}]",
        "cfg.yaml: resources[0].match[0].directory: 'g' must be an absolute path",
    ),
    (
        "resources: [{name: example.com/g, match: [{directory: /g}, {directory: /g/}]}]",
        "cfg.yaml: resources[0].match[1]: repeats match[0]",
    ),
    (
        resources(id_pattern="pci-(?P<id>.*"),
        "cfg.yaml: resources[0].id_pattern: 'pci-(?P<id>.*' is not a regular expression: "
        "missing ), unterminated subpattern at position 4",
    ),
    (
        resources(id_pattern="pci-(.*)-card"),
        "cfg.yaml: resources[0].id_pattern: 'pci-(.*)-card' has no group named id: mark the part of the name "
        "that is the ID with (?P<id>...)",
    ),
    (
        resources(id_pattern=r"card\d+"),  # shown as written, its backslash not doubled
        r"cfg.yaml: resources[0].id_pattern: 'card\d+' has no group named id: mark the part of the name "
        "that is the ID with (?P<id>...)",
    ),
    (
        "resources: [{name: example.com/g, id_pattern: '(?P<id>.*)', usb: [{vendor: '1050', product: '0407'}]}]",
        "cfg.yaml: resources[0].id_pattern: names directory entries, and this resource has none: a USB device's ID "
        "is its serial or port",
    ),
    (
        "resources: [{name: example.com/g, usb: [{vendor: 1050, product: '0407'}]}]",
        "cfg.yaml: resources[0].usb[0].vendor: 1050: must be 4 hex digits in quotes, as lsusb prints them "
        '(e.g. "0407")',
    ),
    (
        "resources: [{name: example.com/g, usb: [{vendor: '1050', product: 0407}]}]",
        "cfg.yaml: resources[0].usb[0].product: 0407 is read by YAML as an octal number, 263: write it in quotes, "
        'as lsusb prints it ("0407")',
    ),
    (
        "resources: [{name: example.com/g, usb: [{vendor: '1050', product: '0407', serial: 0042}]}]",
        "cfg.yaml: resources[0].usb[0].serial: 0042 is read by YAML as an octal number, 34: write it in quotes, "
        'as lsusb prints it ("0042")',
    ),
    (
        "resources: [{name: example.com/g, usb: [{vendor: '1050', product: '0407', serial: 42}]}]",
        "cfg.yaml: resources[0].usb[0].serial: must be a non-empty string, not 42 (put it in quotes)",
    ),
    (
        "resources: [{name: example.com/g, usb: [{vendor: '1050', product: '0407', class: 3}]}]",
        "cfg.yaml: resources[0].usb[0].class: unknown key; expected one of product, serial, vendor",
    ),
    ("resources: [{name: example.com/g, usb: {vendor: '1050'}}]", "cfg.yaml: resources[0].usb: must be a list"),
    (MINIMAL + "dev_root: dev\n", "cfg.yaml: dev_root: 'dev' must be an absolute path"),
    (
        resources(annotations={"example.com/n": "{name}"}),
        "cfg.yaml: resources[0].annotations.example.com/n: '{name}': an annotation is per device, not per entry: "
        "use {id}, {path} or {index}",
    ),
]


# ------------------------------------------------------------------------------------------------
# DRA: the kubelet's plugin watcher and DRAPlugin, ResourceSlices and claims through an API server
# ------------------------------------------------------------------------------------------------


def test_dra_descriptors_are_byte_identical_to_protoc(tmp_path):
    """pluginregistration.proto, dra.proto (and dra.proto in package v1beta1), dra_health.proto
    (and in packages v1beta1 and v1) and the kubelet's podresources.proto against protoc."""
    v1beta1_proto = (
        (HERE / "dra.proto")
        .read_text()
        .replace("package k8s.io.kubelet.pkg.apis.dra.v1;", "package k8s.io.kubelet.pkg.apis.dra.v1beta1;")
    )
    (tmp_path / "dra_v1beta1.proto").write_text(v1beta1_proto)
    # DRAResourceHealth v1beta1 and v1: dra_health.proto's messages in their own packages.
    for package in ("v1beta1", "v1"):
        health = (HERE / "dra_health.proto").read_text().replace("package v1alpha1;", f"package {package};")
        (tmp_path / f"dra_health_{package}.proto").write_text(health)
    cases = [
        ("pluginregistration.proto", HERE, gp.REGISTRATION_FILE_DESCRIPTOR),
        ("dra.proto", HERE, gp.DRA_FILE_DESCRIPTORS[0]),
        ("dra_v1beta1.proto", tmp_path, gp.DRA_FILE_DESCRIPTORS[1]),
        ("dra_health_v1.proto", tmp_path, gp.DRA_HEALTH_FILE_DESCRIPTORS[0]),
        ("dra_health_v1beta1.proto", tmp_path, gp.DRA_HEALTH_FILE_DESCRIPTORS[1]),
        ("dra_health.proto", HERE, gp.DRA_HEALTH_FILE_DESCRIPTOR),
        ("podresources.proto", HERE, gp.PODRESOURCES_FILE_DESCRIPTOR),
    ]
    for name, directory, ours in cases:
        out = tmp_path / f"{name}.bin"
        assert protoc.main(["protoc", f"-I{directory}", f"--descriptor_set_out={out}", name]) == 0, name
        (theirs,) = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file
        assert ours.SerializeToString() == theirs.SerializeToString(), name


def test_dra_service_paths_are_the_kubelets():
    assert sorted(gp.DRA_METHODS) == [
        "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources",
        "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources",
        "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodePrepareResources",
        "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodeUnprepareResources",
        "/pluginregistration.Registration/GetInfo",
        "/pluginregistration.Registration/NotifyRegistrationStatus",
        "/v1.DRAResourceHealth/NodeWatchResources",
        "/v1alpha1.DRAResourceHealth/NodeWatchResources",
        "/v1beta1.DRAResourceHealth/NodeWatchResources",
    ]
    assert gp.DRA_METHODS[gp.NODE_WATCH_RESOURCES].server_streaming


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"attributes": {"a/b/c": 1}},
            "attributes.a/b/c: not a valid name for the API server: must be either a C identifier or a domain, "
            "followed by a slash and a C identifier",
        ),
        (
            {"attributes": {"gpu-model": "x"}},
            "attributes.gpu-model: not a valid name for the API server: 'gpu-model' must be a C identifier (letters, "
            "digits and '_', not starting with a digit) of at most 32 characters",
        ),
        (
            {"attributes": {"a" * 33: "x"}},
            f"attributes.{'a' * 33}: not a valid name for the API server: '{'a' * 33}' must be a C identifier "
            "(letters, digits and '_', not starting with a digit) of at most 32 characters",
        ),
        (
            {"attributes": {"example_com/model": "x"}},
            "attributes.example_com/model: not a valid name for the API server: the domain 'example_com' must be a "
            "DNS subdomain (letters, digits, '-' and '.') of at most 63 characters",
        ),
        (
            {"attributes": {"/model": "x"}},
            "attributes./model: not a valid name for the API server: the domain must not be empty",
        ),
        (
            {"attributes": {"model": "x" * 65}},
            f"attributes.model: not a valid string attribute for the API server: '{'x' * 20}'... has 65 bytes, more "
            "than the API server's 64",
        ),
        (
            {"attributes": {"driverVersion": {"version": "v580.159"}}},
            "attributes.driverVersion: not a valid version attribute for the API server: 'v580.159' is not a semantic "
            "version (semver.org 2.0.0: MAJOR.MINOR.PATCH, e.g. 1.2.3)",
        ),
        (
            {"attributes": {"cores": 2**63}},
            f"attributes.cores: not a valid int attribute for the API server: {2**63} does not fit in 64 bits",
        ),
        (
            {"attributes": {"ratio": 1.5}},
            'attributes.ratio: 1.5: must be a string, a whole number, true or false, {version: "1.2.3"}, or '
            "{file: <path>, type: string|int|bool|version}",
        ),
        (
            {"attributes": {"id": "x"}},
            "attributes.id: is an attribute gopherplug gives every device itself (healthy, id, numaNode, resource, "
            "usbBus, usbPort, usbProduct, usbSerial, usbVendor): choose another name, or one in a domain of your own "
            "(example.com/id)",
        ),
        (
            {"attributes": {f"{DRIVER}/healthy": False}},
            f"attributes.{DRIVER}/healthy: is an attribute gopherplug gives every device itself (healthy, id, "
            "numaNode, resource, usbBus, usbPort, usbProduct, usbSerial, usbVendor): choose another name, or one in a "
            "domain of your own (example.com/healthy)",
        ),
        (
            {"attributes": {"serial": {"file": "serial"}}},
            "attributes.serial.file: 'serial' must be an absolute path",
        ),
        (
            {"attributes": {"serial": {"file": "/sys/{device}/serial"}}},
            "attributes.serial.file: '/sys/{device}/serial': bad placeholder ('device'); use {id}, {path}, {name}, "
            "{target}, {sysfs}",
        ),
        (
            {"attributes": {"serial": {"file": "{sysfs}/serial", "type": "float"}}},
            "attributes.serial.type: 'float': must be one of string, int, bool, version",
        ),
        (
            {"capacity": {"memory": "80GB"}},
            "capacity.memory: '80GB' is not a quantity: a number with an optional suffix (4, 80Gi, 1500m, 2k), or "
            "{file: <path>} to read one",
        ),
        (
            {"capacity": {"memory": {"file": "{sysfs}/mem", "type": "int"}}},
            "capacity.memory.type: 'int': must be one of quantity",
        ),
        (
            {"capacity": {"shares": 2}},
            "capacity.shares: is the capacity gopherplug gives a shared device (replicas): choose another name",
        ),
        (
            {"attributes": {f"a{n}": n for n in range(20)}, "capacity": {f"c{n}": n for n in range(10)}},
            "capacity: 20 attributes and 10 capacities, with the 3 gopherplug gives each device, are 33: the API "
            "server takes at most 32 a device",
        ),
        (
            {"describe": ["/nonexistent/describe-gpus"]},
            "describe[0]: '/nonexistent/describe-gpus' is not an executable file here or on PATH",
        ),
    ],
)
def test_declared_attributes_and_capacity_are_checked_as_the_api_server_checks_a_slice(fields, message):
    """Each mistake the API server would refuse a ResourceSlice for (so every device of the
    pool) is one ConfigError naming the resource and the key; gopherplug's own attributes are not
    silently replaced."""
    with pytest.raises(gp.ConfigError) as caught:
        gp.parse_config(dra_config("/g", "/k", **fields), "cfg.yaml")
    assert str(caught.value) == f"cfg.yaml: resources[0].{message}"


def test_declared_literals_are_typed_and_quantities_canonical_as_the_api_server_stores_them():
    config = gp.parse_config(
        dra_config(
            "/g",
            "/k",
            attributes={"model": "H200", "cores": 132, "ecc": True, "v": {"version": "1.2.3-rc.1+b5"}},
            capacity={"a": "1.5Gi", "b": "1000", "c": 0.5, "d": "143771Mi", "e": "1024Mi", "f": "1e3", "g": "1.5Ki"},
        ),
        "cfg.yaml",
    )
    (resource,) = config.resources
    assert [(d.name, d.type, d.value) for d in resource.attributes] == [
        ("cores", "int", 132),
        ("ecc", "bool", True),
        ("model", "string", "H200"),
        ("v", "version", "1.2.3-rc.1+b5"),
    ]
    # ParseQuantity then CanonicalizeBytes (k8s.io/apimachinery pkg/api/resource/quantity.go)
    assert {d.name: d.value for d in resource.capacity} == {
        "a": "1536Mi",
        "b": "1k",
        "c": "500m",
        "d": "143771Mi",
        "e": "1Gi",
        "f": "1e3",
        "g": "1536",
    }
    # The embedding API takes the same keys.
    embedded = gp.resource_config("example.com/gpu", attributes={"model": "H200"}, capacity={"memory": "80Gi"})
    device = gp.DeviceEntry("0", "/dev/gpu0")
    assert gp.dra_device(embedded, device)["capacity"] == {"memory": {"value": "80Gi"}}
    assert gp.dra_device(embedded, device)["attributes"]["model"] == {"string": "H200"}


@pytest.mark.parametrize(
    "written, stored",
    [
        ("2E", "2E"),  # the exa suffix (10^18), which the API server and the chart accept
        ("1000E", "1e21"),  # past E no suffix: an exponent, which every release keeps as written
        ("1e9999999", "1e9999999"),
        ("1e-9999999", "1e-9"),  # finer than 1n: rounded up, as the parser does
        ("16Ei", "9223372036854775807"),  # binary past 2^63-1: the API server caps it so
        ("-8Ei", "-9223372036854775807"),
        ("9223372036854775807Ki", "9223372036854775807"),
        ("1e2147483648", None),  # past the server's 32-bit scale (1.36 wraps it: 1e4294967297 is 1e1)
        ("1e" + "9" * 5000, None),
        ("1234567890123456789e9999999", None),  # the server would work it out in big numbers
        ("\u0661", None),  # an Arabic-Indic one: Go reads ASCII digits only
    ],
)
def test_any_quantity_is_the_api_servers_canonical_value_or_refused_never_an_exception(written, stored):
    """The exa suffix and any exponent raised; a binary quantity past int64 was
    written as "16Ei" and stored capped, which looked like a field the server dropped."""
    assert gp.canonical_quantity(written) == stored
    assert gp.canonical_quantity(10**5000) == "100e4998"  # past int()'s 4300 digits
    fields = {"capacity": {"memory": written}}
    if stored is None:
        with pytest.raises(gp.ConfigError, match="is not a quantity"):
            gp.parse_config(dra_config("/g", "/k", **fields), "cfg.yaml")
    else:
        (resource,) = gp.parse_config(dra_config("/g", "/k", **fields), "cfg.yaml").resources
        assert resource.capacity[0].value == stored
    # Read from a file or said by describe: left out with a line, or kept as the server keeps it.
    resource = gp.resource_config("example.com/gpu", capacity={"memory": {"file": "/m"}})
    device, problems = gp.with_read_values(
        resource, gp.DeviceEntry("0", "/dev/gpu0"), gp.ReadValues(capacity={"memory": written})
    )
    assert device.capacity == (() if stored is None else (("memory", stored),))
    assert [key for key, _ in problems] == ([] if stored else ["capacity.memory"])


def test_names_and_versions_are_checked_as_go_does_ascii_digits_and_bytes():
    """Python's \\d and str.isdigit() take other scripts' digits, and str.lower() the
    Kelvin sign for a "k"; Go's regexps and the API server take ASCII digits, and count bytes."""
    assert gp.attribute_value_problem("version", "1.2.3") == ""
    assert "not a semantic version" in gp.attribute_value_problem("version", "1\u0661.2.3")
    assert "not a semantic version" in gp.attribute_value_problem("version", "1.2.3-1\u0663")
    kelvin = "\u212a"  # 3 bytes in UTF-8; lower() is "k"
    assert gp.attribute_name_problem("EXAMPLE.com/model") == ""  # upper case is lower-cased, as Go does
    assert "must be a DNS subdomain" in gp.attribute_name_problem(f"example{kelvin}.com/model")
    assert "must be a DNS subdomain" in gp.attribute_name_problem("a" * 62 + kelvin + "/model")  # 65 bytes
    assert gp.attribute_name_problem("m\u0661") != ""  # a C identifier is ASCII
    # A digit int() cannot read is not a port (a traceback before).
    assert "is not host:port" in gp.metrics_address_problem("0.0.0.0:\u00b2")


def test_a_read_attribute_in_the_drivers_domain_never_stands_beside_gopherplugs_own_or_a_literal():
    """The name "<driver>/healthy" is the attribute "healthy" to the API server and the
    scheduler; said by describe or a file, it was published beside gopherplug's own, and CEL saw
    whichever Go's map order gave. gopherplug's own wins, then the configuration's literal."""
    config = gp.parse_config(
        dra_config("/g", "/k", attributes={"model": "H200", "serial": {"file": "/s"}}, capacity={"memory": "80Gi"}),
        "cfg.yaml",
    )
    (resource,) = config.resources
    said = gp.ReadValues(
        attributes={
            f"{DRIVER}/healthy": ("bool", False),
            f"{DRIVER}/model": ("string", "B200"),
            f"{DRIVER}/serial": ("string", "7"),
        },
        capacity={f"{DRIVER}/memory": "40Gi", f"{DRIVER}/cores": "132"},
    )
    device, problems = gp.with_read_values(resource, gp.DeviceEntry("0", "/dev/gpu0"), gp.ReadValues(), said)
    assert dict(problems) == {
        "attributes.healthy": "is an attribute gopherplug gives every device itself: describe's is not used",
        "attributes.model": "the configuration says 'H200', which is used, not describe's 'B200'",
        "capacity.memory": "the configuration says '80Gi', which is used, not describe's '40Gi'",
    }
    published = gp.dra_device(resource, device, DRIVER)
    assert published["attributes"]["healthy"] == {"bool": True}
    assert not [name for name in published["attributes"] if name.startswith(f"{DRIVER}/")]
    assert published["attributes"]["serial"] == {"string": "7"}
    assert published["capacity"] == {"memory": {"value": "80Gi"}, "cores": {"value": "132"}}


def test_dra_config_defaults():
    config = gp.parse_config(dra_config("/g", "/k", device_metadata=None), "cfg.yaml")
    assert config.dra == gp.DraConfig(DRIVER, "/k")
    assert config.dra.device_metadata is True  # KEP-5304's files, unless dra.device_metadata: false
    assert config.dra.metadata_dir == f"/k/plugins/{DRIVER}/dra-device-metadata"
    assert config.dra.registration_socket == f"/k/plugins_registry/{DRIVER}-reg.sock"
    assert config.dra.endpoint == f"/k/plugins/{DRIVER}/dra.sock"
    (resource,) = config.resources
    assert (resource.dra, resource.device_plugin) == (True, False)
    assert resource.cdi == gp.CDIConfig(f"{DRIVER}/gopher")  # DRA gives devices only as CDI devices
    assert gp.parse_config(MINIMAL).resources[0].api == "device-plugin"


def test_dra_socket_names_carry_the_pod_uid_as_the_go_helpers_do(monkeypatch, tmp_path):
    """With POD_UID, two pods of the driver can serve side by side: their sockets differ, named as
    the Go helper's RollingUpdate names them; the flock and checkpoint stay the driver's."""
    path = tmp_path / "cfg.yaml"
    path.write_text(dra_config("/g", "/k"))
    monkeypatch.setenv("POD_UID", POD_UID)
    dra = gp.load_config(str(path)).dra
    assert dra.registration_socket == f"/k/plugins_registry/{DRIVER}-{POD_UID}-reg.sock"
    assert dra.endpoint == f"/k/plugins/{DRIVER}/dra-{POD_UID}.sock"
    assert (dra.checkpoint, dra.serialize_lock) == (
        f"/k/plugins/{DRIVER}/checkpoint.json",
        f"/k/plugins/{DRIVER}/serialize.lock",
    )
    # Too long for a unix socket: the UID's hash, then the hash of both (RollingUpdateRegistrarSocketFile).
    uid_hash = base64.urlsafe_b64encode(hashlib.sha256(POD_UID.encode()).digest()[:8]).decode().rstrip("=")
    deep = "/" + "k" * 25
    path.write_text(dra_config("/g", deep))
    assert gp.load_config(str(path)).dra.registration_socket == f"{deep}/plugins_registry/{DRIVER}-{uid_hash}-reg.sock"
    both = base64.urlsafe_b64encode(hashlib.sha256(f"{DRIVER}\0{POD_UID}".encode()).digest()[:16]).decode()
    deeper = "/" + "k" * 49
    path.write_text(dra_config("/g", deeper))
    dra = gp.load_config(str(path)).dra
    assert dra.registration_socket == f"{deeper}/plugins_registry/dra-{both.rstrip('=')}-reg.sock"
    assert dra.endpoint == f"{deeper}/plugins/{DRIVER}/dra-{uid_hash}.sock"
    monkeypatch.setenv("POD_UID", "../x")
    with pytest.raises(gp.ConfigError) as info:
        gp.load_config(str(path))
    assert str(info.value) == (
        "POD_UID: '../x' is not a pod UID: set it from the downward API (valueFrom.fieldRef.fieldPath: "
        "metadata.uid), or leave it unset"
    )


@pytest.mark.slow
def test_check_config_without_a_device_plugin_dir_says_where_serve_will_look(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump({"resources": [{"name": RESOURCE, "directory": str(tmp_path)}]}))
    result = run_cli("check-config", "--config", str(path))
    assert result.stdout.splitlines()[0] == (
        f"{path}: OK: 1 resource(s): {RESOURCE} ({tmp_path}/*); kubelet at the first of "
        f"{', '.join(gp.KNOWN_DEVICE_PLUGIN_DIRS)} to hold kubelet.sock at start"
    )


@pytest.mark.slow
def test_check_config_of_a_dra_only_configuration_names_the_driver_not_a_device_plugin_dir(sockdir):
    tmp_path = Path(sockdir)  # the kubelet root holds sockets: a short path
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "gopher0").touch()
    path = tmp_path / "cfg.yaml"
    path.write_text(dra_config(tmp_path / "g", tmp_path / "k", cdi={"kind": "example.com/gopher"}))
    result = run_cli("check-config", "--config", str(path), env={"NODE_NAME": "node-1"})
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout.splitlines()[0] == (
        f"{path}: OK: 1 resource(s): example.com/gopher ({tmp_path}/g/*); "
        f"DRA driver {DRIVER}, kubelet root {tmp_path}/k"
    )


@pytest.mark.slow
def test_check_config_of_a_dra_configuration_says_that_serve_needs_node_name(sockdir):
    # serve stops at start without it (exit 1); check-config named the pools after the host name, silently.
    tmp_path = Path(sockdir)
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "gopher0").touch()
    path = tmp_path / "cfg.yaml"
    path.write_text(dra_config(tmp_path / "g", tmp_path / "k"))
    warning = (
        "gopherplug: warning: NODE_NAME is not set: serve would stop at start, as the DRA driver names this node's "
        f"pools after it (in a DaemonSet from spec.nodeName); shown here with the host name, {socket.gethostname()}\n"
    )
    result = run_cli("check-config", "--config", str(path), env={"NODE_NAME": ""})
    assert (result.returncode, result.stderr) == (0, warning)
    assert f"of pool {socket.gethostname()}/example.com/gopher gives a container:" in result.stdout
    strict = run_cli("check-config", "--strict", "--config", str(path), env={"NODE_NAME": ""})
    assert (strict.returncode, strict.stderr) == (
        1,
        f"{warning}gopherplug: --strict: DRA driver {DRIVER}: NODE_NAME is not set\n",
    )
    assert run_cli("check-config", "--strict", "--config", str(path), env={"NODE_NAME": "node-1"}).returncode == 0


@pytest.mark.slow
def test_check_config_shows_what_a_dra_claim_gives_a_container(sockdir):
    # NodePrepareResources' CDI IDs and the CDI spec's edits for the first healthy device, with its pool;
    # the env as the container sees it: the request's <ENV>, as Allocate gives it, and the device's own.
    tmp_path = Path(sockdir)
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "Gopher0").touch()
    path = tmp_path / "cfg.yaml"
    mounts = [{"host_path": "/etc/gophers", "container_path": "/run/{id}", "read_only": True}]
    specs = [{"host_path": "{path}", "container_path": "/dev/{id}", "permissions": "rw"}]
    allowed = {"allowed_host_paths": ["/etc/gophers"]}
    path.write_text(dra_config(tmp_path / "g", tmp_path / "k", mounts=mounts, device_specs=specs, **allowed))
    result = run_cli("check-config", "--config", str(path), env={"NODE_NAME": "node-1"})
    assert (result.returncode, result.stderr) == (0, "")
    name = gp.dra_device_name("Gopher0")
    assert result.stdout.splitlines()[4:] == [
        f"  a claim for device {name} of pool node-1/example.com/gopher gives a container:",
        "    attributes resource=example.com/gopher, id=Gopher0, healthy=true",
        f"    cdi {DRIVER}/gopher=Gopher0",
        f"    cdi {DRIVER}/gopher=<claimUID>_<request>",
        f"    device /dev/Gopher0 <- {tmp_path}/g/Gopher0 rw",
        "    mount /run/Gopher0 <- /etc/gophers ro",
        "    env GOPHER_DEVICES=Gopher0",
        "    env GOPHER_DEVICES_GOPHER0=Gopher0",
    ]


@pytest.mark.slow
def test_check_config_shows_each_devices_dra_name(sockdir):
    # A ResourceSlice names a device by a DNS label: ttyS0 is ttys0-45b83132 there, in claims' results
    # and in `kubectl get resourceslices`; check-config named only the first healthy device's.
    tmp_path = Path(sockdir)
    (tmp_path / "g").mkdir()
    for name in ("ttyS0", "g1", "0000:00:02.0"):
        (tmp_path / "g" / name).touch()
    path = tmp_path / "cfg.yaml"
    path.write_text(dra_config(tmp_path / "g", tmp_path / "k"))
    result = run_cli("check-config", "--config", str(path), env={"NODE_NAME": "node-1"})
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout.splitlines()[1:6] == [
        f"example.com/gopher: 3 devices, 3 healthy, from {tmp_path}/g/*",
        "  ID            DRA NAME               HEALTH     PATH",
        f"  0000:00:02.0  0000-00-02-0-537acfdf  Healthy    {tmp_path}/g/0000:00:02.0",
        f"  g1            g1                     Healthy    {tmp_path}/g/g1",
        f"  ttyS0         ttys0-45b83132         Healthy    {tmp_path}/g/ttyS0",
    ]


@pytest.mark.slow
def test_check_config_shows_what_a_share_of_a_shared_dra_device_gives_a_container(sockdir):
    # replicas under DRA alone: each device shared by that many claims; a claim's container gets its
    # share's CDI device and env var (the scheduler's shareID shown as <shareID>).
    tmp_path = Path(sockdir)
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "gopher0").touch()
    path = tmp_path / "cfg.yaml"
    path.write_text(dra_config(tmp_path / "g", tmp_path / "k", replicas=5))
    result = run_cli("check-config", "--config", str(path), env={"NODE_NAME": "node-1"})
    assert (result.returncode, result.stderr) == (0, "")
    lines = result.stdout.splitlines()
    assert lines[1] == f"example.com/gopher: 1 device, 1 healthy (each shared by 5 claims), from {tmp_path}/g/*"
    assert lines[4:] == [
        "  a claim for a share of device gopher0 (1 of 5) of pool node-1/example.com/gopher gives a container:",
        "    attributes resource=example.com/gopher, id=gopher0, healthy=true",
        f"    cdi {DRIVER}/gopher=gopher0-<shareID>",
        f"    cdi {DRIVER}/gopher=<claimUID>_<request>",
        "    env GOPHER_DEVICES=gopher0",
        "    env GOPHER_DEVICES_GOPHER0=gopher0",
        "    env GOPHER_DEVICES_GOPHER0_SHARE=<shareID>",
    ]


def cdi_v110_verdict(kind):
    """What CDI v1.1.0, the library containerd 2.x bundles, makes of a spec's ``kind``: "ok", "error"
    or "panic". Written from ParseQualifier and validateVendorOrClassName in
    container-device-interface pkg/parser/parser.go, bug included: it checks the first character,
    then loops over name[1:len-1], which Go cannot slice for a one-character name."""
    vendor, slash, device_class = kind.partition("/")
    if not slash or not vendor or not device_class:
        return "error"  # ParseQualifier gives an empty vendor: "empty name"
    for name in (vendor, device_class):
        if not (name[0].isascii() and name[0].isalpha()):
            return "error"
        if len(name) == 1:
            return "panic"  # slice bounds out of range [1:0]
        if any(not (c.isascii() and (c.isalnum() or c in "_-.")) for c in name[1:-1]):
            return "error"
        if not (name[-1].isascii() and name[-1].isalnum()):
            return "error"
    return "ok"


def cdi_device_name_ok(name):
    """ValidateDeviceName in the same file: one character is allowed there (it is guarded)."""
    return (
        bool(name)
        and all(c.isascii() and (c.isalnum() or c in "_-.:") for c in name)
        and (name[0].isalnum() and name[-1].isalnum())
    )


@pytest.mark.parametrize(
    ("kind", "accepted"),
    [
        ("example.com/gopher", True),
        ("ab/cd", True),
        ("example.com/gpu.v2_x-1", True),
        ("example.com/" + "g" * 63, True),
        ("example.com/a", False),  # CDI v1.1.0 panics: containerd 2.x would not start
        ("a/gopher", False),
        ("a/b", False),
        ("example.com/3d", False),  # CDI wants a letter first
        ("3com.example.com/gpu", False),
        ("example.com/gpu-", False),
        ("example.com/g/pu", False),
        ("example.com/" + "g" * 64, False),  # gopherplug's own bound, for the file name
    ],
)
def test_cdi_kinds_accepted_are_ones_cdi_takes(kind, accepted):
    """A kind a user writes is accepted only if CDI takes it without crashing."""
    text = resources(cdi={"kind": kind})
    if accepted:
        assert gp.parse_config(text).resources[0].cdi.kind == kind
        assert cdi_v110_verdict(kind) == "ok"
    else:
        with pytest.raises(gp.ConfigError, match=r"^cfg\.yaml: resources\[0\]\.cdi\.kind: "):
            gp.parse_config(text, "cfg.yaml")


@pytest.mark.parametrize(
    ("driver", "name", "kind"),
    [
        (DRIVER, "example.com/gopher", f"{DRIVER}/gopher"),  # valid names do not change
        (DRIVER, "example.com/Gpu_2.x", f"{DRIVER}/Gpu_2.x"),
        (DRIVER, "example.com/a", f"{DRIVER}/xa"),  # was DRIVER/a: containerd 2.x crashed
        (DRIVER, "example.com/7", f"{DRIVER}/x7"),
        (DRIVER, "example.com/3d", f"{DRIVER}/x3d"),  # was refused, though the user set no cdi
        (DRIVER, "e/" + "3" * 62, f"{DRIVER}/x{'3' * 62}"),  # the longest such name: 63 characters
        ("g", "example.com/gopher", "xg/gopher"),
        ("3com.example.com", "example.com/gopher", "x3com.example.com/gopher"),
    ],
)
def test_dra_derived_cdi_kinds_are_valid(driver, name, kind):
    (resource,) = gp.parse_config(dra_config("/g", "/k", {"dra": {"driver": driver}}, name=name)).resources
    assert resource.cdi.kind == kind
    assert cdi_v110_verdict(kind) == "ok"


def test_a_default_env_var_the_loader_reads_says_to_set_env():
    """example.com/ld would get LD_DEVICES, which the dynamic loader may read: the user wrote no env,
    so the line says where the name came from and what to do (hypothesis found it)."""
    with pytest.raises(gp.ConfigError) as error:
        gp.parse_config(resources(name="example.com/ld"))
    assert str(error.value) == (
        "<config>: resources[0].env: 'LD_DEVICES', the default for 'example.com/ld', is given meaning by the "
        "shell or the dynamic loader: set env"
    )


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(
    driver=st.from_regex(r"[a-z0-9]([-a-z0-9]{0,8}[a-z0-9])?(\.[a-z0-9]{1,5}){0,2}", fullmatch=True),
    short=st.from_regex(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,50}[A-Za-z0-9])?", fullmatch=True),
    device_id=st.from_regex(r"[A-Za-z0-9._:-]{1,20}", fullmatch=True),
)
def test_dra_derived_cdi_names_always_pass_cdi(driver, short, device_id):
    """Over every driver and resource name Kubernetes allows: the derived kind is one CDI takes, and
    unchanged where it was already; a device ID gopherplug takes is a CDI device name."""
    name = f"example.com/{short}"
    try:
        (resource,) = gp.parse_config(dra_config("/g", "/k", {"dra": {"driver": driver}}, name=name)).resources
    except gp.ConfigError as error:  # a name too long for a device attribute, a socket path too long,
        # a default env var the dynamic loader reads (example.com/ld: LD_DEVICES)
        problems = ("at most 64 characters", "unix sockets allow", "the dynamic loader: set env")
        assert any(problem in str(error) for problem in problems), str(error)
        return
    assert cdi_v110_verdict(resource.cdi.kind) == "ok"
    if cdi_v110_verdict(f"{driver}/{short}") == "ok":
        assert resource.cdi.kind == f"{driver}/{short}"
    if not gp._id_problem(resource, device_id):
        assert cdi_device_name_ok(device_id)


DRA_BAD_CONFIGS = [
    (
        resources(api="dra"),
        "cfg.yaml: resources[0].api: dra needs the DRA driver: add dra: {driver: <name>} at the top of the file",
    ),
    (resources(api="cdi"), "cfg.yaml: resources[0].api: 'cdi': must be one of device-plugin, dra"),
    # Accepted before 0.2: what a node that served a resource twice is told to do instead.
    (
        dra_config("/g", "/k", api="both", allow_double_booking=True),
        "cfg.yaml: resources[0].allow_double_booking: is no longer accepted: a node serves a resource through one "
        "API: api: device-plugin or api: dra, with the DRA DeviceClass's extendedResourceName for pods that ask for "
        "it in resources.limits (docs/dra.md: Moving a resource from the device plugin to DRA)",
    ),
    (
        dra_config("/g", "/k", api="both"),
        "cfg.yaml: resources[0].api: both is no longer accepted: a node serves a resource through one API: "
        "api: device-plugin or api: dra, with the DRA DeviceClass's extendedResourceName for pods that ask for it "
        "in resources.limits (docs/dra.md: Moving a resource from the device plugin to DRA)",
    ),
    (
        dra_config("/g", "/k", replicas=2, preferred="spread"),
        "cfg.yaml: resources[0].preferred: is for the device-plugin API, and this resource has api: dra "
        "(the scheduler chooses devices, by the claim's selectors)",
    ),
    (
        dra_config("/g", "/k", api="device-plugin"),
        "cfg.yaml: dra: no resource has api: dra, so the driver would offer nothing",
    ),
    (
        dra_config("/g", "/k").replace(DRIVER, "Gopherplug"),
        "cfg.yaml: dra.driver: 'Gopherplug': must be a lower-case DNS subdomain of at most 63 characters, "
        "e.g. gopherplug.example.com",
    ),
    (
        dra_config("/g", "/" + "k" * 60),
        f"cfg.yaml: dra: the socket /{'k' * 60}/plugins_registry/{DRIVER}-reg.sock would pass the 107 bytes unix "
        "sockets allow: choose a shorter driver name",
    ),
    (
        dra_config("/g", "/k", name="example.com/" + "g" * 60),
        "cfg.yaml: resources[0].name: with api: dra, the name is a device attribute: at most 64 characters",
    ),
]


@pytest.mark.parametrize(("text", "message"), BAD_CONFIGS + DRA_BAD_CONFIGS)
def test_bad_config_names_file_key_and_fix(text, message):
    """Every table of bad configurations, the device plugin's and DRA's: one line, naming the file,
    the key and the fix."""
    with pytest.raises(gp.ConfigError) as info:
        gp.parse_config(text, "cfg.yaml")
    assert str(info.value) == message


def hashlib_hex(text):
    return hashlib.sha256(text.encode()).hexdigest()


@pytest.mark.parametrize(
    ("device_id", "name"),
    [
        ("gopher0", "gopher0"),
        ("ttyUSB0", "ttyusb0-" + hashlib_hex("ttyUSB0")[:8]),
        ("0000:03:00.0", "0000-03-00-0-" + hashlib_hex("0000:03:00.0")[:8]),
        ("x" * 63, "x" * 63),
        ("_", hashlib_hex("_")[:16]),
    ],
)
def test_dra_device_names_are_dns_labels_and_distinct(device_id, name):
    assert gp.dra_device_name(device_id) == name
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", name)


@pytest.mark.slow
def test_dra_slices_split_at_the_apis_limit_and_pass_the_schema(tmp_path):
    (resource,) = gp.parse_config(dra_config("/g", "/k")).resources
    devices = {
        f"g{i}": gp.DeviceEntry(f"g{i}", f"/g/g{i}", numa_node=i % 2) for i in range(gp.DRA_MAX_DEVICES_PER_SLICE + 2)
    }
    healthy = gp.resource_slices(DRIVER, "node-1", resource, devices, 7)
    assert [len(item["spec"]["devices"]) for item in healthy] == [128, 2]  # ResourceSliceMaxDevices in k8s.io/api
    devices["g1"] = dataclasses.replace(devices["g1"], health=gp.UNHEALTHY, problem="gone")
    slices = gp.resource_slices(DRIVER, "node-1", resource, devices, 7)
    # A device with a taint: ResourceSliceMaxDevicesWithTaintsOrConsumesCounters
    assert [len(item["spec"]["devices"]) for item in slices] == [64, 64, 2]
    assert {json.dumps(item["spec"]["pool"]) for item in slices} == {
        json.dumps({"name": "node-1/example.com/gopher", "generation": 7, "resourceSliceCount": 3})
    }
    assert slices[0]["spec"]["devices"][1] == {
        "name": "g1",
        "attributes": {
            "resource": {"string": "example.com/gopher"},
            "id": {"string": "g1"},
            "healthy": {"bool": False},
            "numaNode": {"int": 1},
            "resource.kubernetes.io/numaNode": {"int": 1},
        },
        "taints": [{"key": f"{DRIVER}/unhealthy", "value": "gone", "effect": "NoSchedule"}],
    }
    empty = gp.resource_slices(DRIVER, "node-1", resource, {}, 1)
    assert [item["spec"]["devices"] for item in empty] == [[]]
    path = tmp_path / "slices.yaml"
    path.write_text(yaml.safe_dump_all([*slices, *empty]))
    for version in ("1.34.0", "1.37.0"):  # resource.k8s.io/v1 is GA since 1.34
        result = check("kubernetes-validate", "--strict", "-k", version, str(path))
        assert result.returncode == 0, result.stdout + result.stderr
        assert result.stdout.count("passed") == 4


@pytest.mark.slow
def test_dra_replicas_publish_each_device_shared_by_that_many_claims(tmp_path):
    """replicas: 3 under DRA (KEP-5075): each device allows multiple allocations and has a capacity
    of 3 shares, of which a claim that asks for nothing consumes 1. The API server takes it (the
    stand-in, and kubernetes-validate's schema of the versions that have the fields); capacity does
    not lower the 128 devices a slice may hold, as taints do."""
    (resource,) = gp.parse_config(dra_config("/g", "/k", replicas=3)).resources
    devices = {f"g{i}": gp.DeviceEntry(f"g{i}", f"/g/g{i}") for i in range(gp.DRA_MAX_DEVICES_PER_SLICE + 1)}
    slices = gp.resource_slices(DRIVER, "node-1", resource, devices, 1)
    assert [len(item["spec"]["devices"]) for item in slices] == [128, 1]
    assert slices[0]["spec"]["devices"][0] == {
        "name": "g0",
        "attributes": {
            "resource": {"string": "example.com/gopher"},
            "id": {"string": "g0"},
            "healthy": {"bool": True},
        },
        "allowMultipleAllocations": True,
        "capacity": {
            "shares": {
                "value": "3",
                "requestPolicy": {"default": "1", "validRange": {"min": "1", "max": "3", "step": "1"}},
            }
        },
    }
    assert [standins.resource_slice_causes(item) for item in slices] == [[], []]
    (alone,) = gp.parse_config(dra_config("/g", "/k")).resources  # replicas: 1, the default: not shared
    assert set(gp.dra_device(alone, devices["g0"])) == {"name", "attributes"}
    path = tmp_path / "slices.yaml"
    path.write_text(yaml.safe_dump_all(slices))
    for version in ("1.34.0", "1.37.0"):  # the fields are in resource.k8s.io/v1 since 1.34 (alpha then)
        result = check("kubernetes-validate", "--strict", "-k", version, str(path))
        assert result.returncode == 0, result.stdout + result.stderr


def pci_sysfs(root):
    """A sysfs tree with a GPU at 0000:03:00.0 behind the bridge 0000:00:01.0 of root complex
    pci0000:00 (NUMA node 1), whose drm class device card0 is /dev/null's (1:3); and a USB serial
    adapter on the host controller 0000:00:14.0, whose tty is /dev/zero's (1:5). /dev/full (1:7)
    has no entry. Links as the kernel makes them: dev/char/MAJ:MIN to the class device, its
    `device` to its parent, each device's `subsystem` to its bus."""
    devices = root / "devices" / "pci0000:00"
    gpu = devices / "0000:00:01.0" / "0000:03:00.0"
    tty = devices / "0000:00:14.0" / "usb1" / "1-1" / "1-1:1.0" / "ttyUSB0" / "tty" / "ttyUSB0"
    for directory, bus in [
        (devices / "0000:00:01.0", "pci"),
        (gpu, "pci"),
        (devices / "0000:00:14.0", "pci"),
        (devices / "0000:00:14.0" / "usb1", "usb"),
        (devices / "0000:00:14.0" / "usb1" / "1-1", "usb"),
        (devices / "0000:00:14.0" / "usb1" / "1-1" / "1-1:1.0", "usb"),
        (tty.parent.parent, "usb-serial"),
    ]:
        directory.mkdir(parents=True, exist_ok=True)
        (root / "bus" / bus).mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(root / "bus" / bus, directory), directory / "subsystem")
    (gpu / "numa_node").write_text("1\n")
    card = gpu / "drm" / "card0"
    card.mkdir(parents=True)
    os.symlink("../..", card / "device")
    tty.mkdir(parents=True)
    os.symlink("../../../ttyUSB0", tty / "device")
    (root / "dev" / "char").mkdir(parents=True)
    os.symlink(os.path.relpath(card, root / "dev" / "char"), root / "dev" / "char" / "1:3")
    os.symlink(os.path.relpath(tty, root / "dev" / "char"), root / "dev" / "char" / "1:5")
    return str(root)


@pytest.mark.slow
def test_check_config_lists_each_devices_attributes_and_capacity_from_literals_sysfs_files_and_describe(tmp_path):
    """Check-config shows what each device's ResourceSlice entry will carry: the literals,
    what its files say ({sysfs}: the node's sysfs directory, here a GPU's PCI function's vendor), and
    what describe says (run once, for both devices). A node sysfs knows nothing of gets no {sysfs}
    value, one line; a standard attribute describe gives where sysfs knows none is used (the NVIDIA
    case), and where sysfs knows it, sysfs's stays, said when describe's differs. The slices of
    those devices are what the strict API server takes."""
    devices = tmp_path / "devices"
    devices.mkdir()
    for name, target in [("gpu", "/dev/null"), ("full", "/dev/full")]:
        os.symlink(target, devices / name)
    sysfs = pci_sysfs(tmp_path / "sys")
    (tmp_path / "sys" / "devices" / "pci0000:00" / "0000:00:01.0" / "0000:03:00.0" / "vendor").write_text("0x10de\n")
    describe = tmp_path / "describe"
    describe.write_text(
        f"#!{sys.executable}\nimport json\nprint(json.dumps({{"
        '"gpu": {"attributes": {"resource.kubernetes.io/pciBusID": "0000:09:00.0", "uuid": "GPU-1"}}, '
        '"full": {"attributes": {"resource.kubernetes.io/pciBusID": "0000:0a:00.0"}, "capacity": {"memory": 2048}}'
        "}))\n"
    )
    describe.chmod(0o755)
    fields = {
        "allowed_host_paths": ["/dev"],
        "attributes": {
            "productName": "NVIDIA H200",
            "driverVersion": {"version": "580.159.4"},
            "vendor": {"file": "{sysfs}/device/vendor", "type": "int"},
        },
        "capacity": {"memory": {"file": "{sysfs}/device/memory"}, "slots": 4},
        "describe": [str(describe)],
    }
    path = tmp_path / "gopherplug.yaml"
    path.write_text(dra_config(str(devices), "/k", {"sysfs_root": sysfs}, **fields))
    result = run_cli("check-config", "--config", str(path), env={"NODE_NAME": "node-1"})
    assert result.returncode == 0, result.stderr
    report = result.stdout.split("example.com/gopher: 2 devices", 1)[1].split("  a claim for", 1)[0]
    gpu_dir = f"{sysfs}/dev/char/1:3"
    assert report.splitlines()[1:] == [
        f"  describe: {describe}",  # what runs
        "  warning: device full: attributes.vendor: {sysfs}/device/vendor: no sysfs directory is known for this device",
        "  warning: device full: capacity.memory: {sysfs}/device/memory: no sysfs directory is known for this device",
        f"  warning: device gpu: capacity.memory: cannot read {gpu_dir}/device/memory: No such file or directory",
        "  warning: device gpu: attributes.resource.kubernetes.io/pciBusID: sysfs says '0000:03:00.0', which is used, "
        "not describe's '0000:09:00.0'",
        "  ID    DRA NAME  HEALTH     PATH",
        "  full  full      Healthy    " + f"{devices}/full -> /dev/full",
        '        attributes: driverVersion=580.159.4 (version), productName="NVIDIA H200", '
        'resource.kubernetes.io/pciBusID="0000:0a:00.0"',
        "        capacity: slots=4, memory=2048",
        "  gpu   gpu       Healthy    " + f"{devices}/gpu -> /dev/null",
        '        attributes: driverVersion=580.159.4 (version), productName="NVIDIA H200", uuid="GPU-1", vendor=4318',
        "        capacity: slots=4",
    ]
    config = gp.load_config(str(path))
    (resource,) = config.resources
    scan, _ = gp.described_scan(resource, gp.scan_directory(resource, sysfs))
    slices = gp.resource_slices(DRIVER, "node-1", resource, {d.id: d for d in scan.devices}, 1, NODE_UID)
    assert [standins.resource_slice_causes(item) for item in slices] == [[]]
    gpu = next(d for d in slices[0]["spec"]["devices"] if d["name"] == "gpu")
    assert gpu["attributes"]["resource.kubernetes.io/pciBusID"] == {"string": "0000:03:00.0"}


def test_dra_standard_attributes_of_pci_devices_from_sysfs(tmp_path):
    """resource.kubernetes.io/pciBusID and pcieRoot as deviceattribute/pci.go (kubernetes/kubernetes
    staging/src/k8s.io/dynamic-resource-allocation) makes them, for a PCI device's node only, and
    resource.kubernetes.io/numaNode beside gopherplug's own numaNode."""
    devices = tmp_path / "devices"
    devices.mkdir()
    for name, target in [("gpu", "/dev/null"), ("serial", "/dev/zero"), ("full", "/dev/full")]:
        os.symlink(target, devices / name)
    sysfs = pci_sysfs(tmp_path / "sys")
    (dra,) = gp.parse_config(dra_config(str(devices), "/k", allowed_host_paths=["/dev"])).resources
    found = {d.id: d for d in gp.scan_directory(dra, sysfs).devices}
    assert {i: d.pci for i, d in found.items()} == {
        "full": None,
        "gpu": gp.PciAddress("0000:03:00.0", "pci0000:00"),
        "serial": None,  # its host controller is PCI, the adapter is USB
    }
    # Only slices show it: a device plugin's scan does not walk sysfs for it.
    plugin = resource_in(devices, allowed_host_paths=["/dev"])
    assert all(d.pci is None for d in gp.scan_directory(plugin, sysfs).devices)
    (item,) = gp.resource_slices(DRIVER, "node-1", dra, found, 1)
    assert item["spec"]["devices"][1] == {
        "name": "gpu",
        "attributes": {
            "resource": {"string": "example.com/gopher"},
            "id": {"string": "gpu"},
            "healthy": {"bool": True},
            "numaNode": {"int": 1},
            "resource.kubernetes.io/numaNode": {"int": 1},
            "resource.kubernetes.io/pciBusID": {"string": "0000:03:00.0"},
            "resource.kubernetes.io/pcieRoot": {"string": "pci0000:00"},
        },
    }
    assert standins.resource_slice_causes(item) == []


def test_dra_numa_node_of_a_node_under_a_pci_function_is_the_functions(tmp_path):
    """A virtio device's node (a virtio-console port here; virtio-blk's disks alike) has as its
    sysfs device the virtio device, which has no numa_node of its own; the PCI function above it
    has. deviceattribute reads the standard numaNode of a PCI device from the function
    (kubernetes/kubernetes staging/src/k8s.io/dynamic-resource-allocation/deviceattribute/
    numa_linux.go, GetNUMANodeAttributeByPCIBusID: bus/pci/devices/<bus ID>/numa_node)."""
    root = tmp_path / "sys"
    function = root / "devices" / "pci0000:00" / "0000:00:04.0"
    virtio = function / "virtio2"
    port = virtio / "virtio-ports" / "vport2p1"
    for directory, bus in [(function, "pci"), (virtio, "virtio")]:
        directory.mkdir(parents=True, exist_ok=True)
        (root / "bus" / bus / "devices").mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(root / "bus" / bus, directory), directory / "subsystem")
        os.symlink(
            os.path.relpath(directory, root / "bus" / bus / "devices"), root / "bus" / bus / "devices" / directory.name
        )
    (function / "numa_node").write_text("1\n")
    port.mkdir(parents=True)
    os.symlink("../../../virtio2", port / "device")
    (root / "dev" / "char").mkdir(parents=True)
    os.symlink(os.path.relpath(port, root / "dev" / "char"), root / "dev" / "char" / "1:7")
    devices = tmp_path / "devices"
    devices.mkdir()
    os.symlink("/dev/full", devices / "port")
    (dra,) = gp.parse_config(dra_config(str(devices), "/k", allowed_host_paths=["/dev"])).resources
    (device,) = gp.scan_directory(dra, str(root)).devices
    attributes = gp.dra_device(dra, device)["attributes"]
    assert {k: v for k, v in attributes.items() if k not in ("resource", "id", "healthy")} == {
        "numaNode": {"int": 1},
        "resource.kubernetes.io/numaNode": {"int": 1},
        "resource.kubernetes.io/pciBusID": {"string": "0000:00:04.0"},
        "resource.kubernetes.io/pcieRoot": {"string": "pci0000:00"},
    }


def test_dra_usb_attributes_in_the_drivers_domain(tmp_path):
    sysfs = usb_tree(tmp_path)
    dev = str(tmp_path / "dev")
    usb_nodes(dev, "bus/usb/001/003", "hidraw0", "bus/usb/002/002", "video0")
    config = config_with(
        top={"dev_root": dev, "sysfs_root": sysfs},
        usb=[{"vendor": "1050", "product": "0407"}, {"vendor": "046d", "product": "0825"}],
        allowed_host_paths=["/dev/null"],
    )
    scan = gp.scan_directory(config.resources[0], sysfs, dev)
    attributes = {d.id: gp.dra_device(config.resources[0], d)["attributes"] for d in scan.devices}
    assert {i: {k: v for k, v in a.items() if k.startswith("usb")} for i, a in attributes.items()} == {
        "12345678": {
            "usbVendor": {"string": "1050"},
            "usbProduct": {"string": "0407"},
            "usbSerial": {"string": "12345678"},
            "usbBus": {"int": 1},
            "usbPort": {"string": "1-1.1"},
        },
        "2-3": {  # no serial
            "usbVendor": {"string": "046d"},
            "usbProduct": {"string": "0825"},
            "usbBus": {"int": 2},
            "usbPort": {"string": "2-3"},
        },
    }
    assert not any(k.startswith("resource.kubernetes.io/pci") for a in attributes.values() for k in a)


def test_dra_api_server_stand_in_refuses_attributes_as_the_real_one_does():
    """validateQualifiedName and validateDeviceAttribute (pkg/apis/resource/validation/validation.go):
    a wrong attribute name or value is a 422 with these causes."""
    (resource,) = gp.parse_config(dra_config("/g", "/k")).resources
    (item,) = gp.resource_slices(DRIVER, "node-1", resource, {"g0": gp.DeviceEntry("g0", "/g/g0")}, 1)
    attributes = item["spec"]["devices"][0]["attributes"]
    attributes.update(
        {
            "resource.kubernetes.io/pci-bus-id": {"string": "0000:03:00.0"},
            "d" * 64 + "/x": {"int": 1},
            "a" * 33: {"bool": True},
            "long": {"string": "s" * 65},
            "two": {"int": 1, "bool": True},
            "version": {"version": "1.2"},
        }
    )
    prefix = "spec.devices[0].attributes"
    assert [(c["field"], c["reason"]) for c in standins.resource_slice_causes(item)] == [
        (f"{prefix}[resource.kubernetes.io/pci-bus-id]", "FieldValueInvalid"),
        (f"{prefix}[{'d' * 64}/x]", "FieldValueTooLong"),
        (f"{prefix}[{'a' * 33}]", "FieldValueTooLong"),
        (f"{prefix}[long].string", "FieldValueTooLong"),
        (f"{prefix}[two]", "FieldValueInvalid"),
        (f"{prefix}[version].version", "FieldValueInvalid"),
    ]
    assert standins.resource_slice_causes(item)[0]["message"].startswith(
        'Invalid value: "pci-bus-id": a valid C identifier'
    )


def test_sysfs_attributes_never_take_a_device_past_the_api_servers_32():
    """29 literals pass with gopherplug's 3 (32), and a PCI device's NUMA node and
    address add 4: the API server refused the slice, and the whole pool left the node. check-config
    warns of it; at runtime the last by name are left out, a line each, and the slice passes."""
    literals = {f"a{n:02}": n for n in range(27)}
    config = gp.parse_config(dra_config("/g", "/k", attributes=literals, capacity={"m": "1Gi", "n": "2"}), "cfg.yaml")
    assert config.warnings == (
        "cfg.yaml: resources[0].attributes: with the capacities and gopherplug's own, 32, and up to 4 sysfs gives "
        "a PCI device (NUMA node, PCI address) a device may have 36: past 32, the last by name are left out",
    )
    (resource,) = config.resources
    device = gp.DeviceEntry("g0", "/g/g0", True, numa_node=1, pci=gp.PciAddress("0000:03:00.0", "pci0000:00"))
    entry, problems = gp.with_read_values(resource, device, gp.ReadValues())
    left_out = ["attributes.a25", "attributes.a26", "capacity.m", "capacity.n"]  # the last by name
    assert problems == [(key, gp._TOO_MANY_VALUES) for key in left_out]
    (item,) = gp.resource_slices(DRIVER, "node-1", resource, {"g0": entry}, 1)
    (published,) = item["spec"]["devices"]
    assert len(published["attributes"]) == 32 and "capacity" not in published
    assert published["attributes"]["resource.kubernetes.io/pciBusID"] == {"string": "0000:03:00.0"}
    assert standins.resource_slice_causes(item) == []
    # Without sysfs's, all of them; and the stand-in refuses 33, as the API server does.
    (item,) = gp.resource_slices(DRIVER, "node-1", resource, {"g0": gp.DeviceEntry("g0", "/g/g0")}, 1)
    assert standins.resource_slice_causes(item) == []
    item["spec"]["devices"][0]["attributes"]["one_more"] = {"int": 1}
    assert [c["field"] for c in standins.resource_slice_causes(item)] == ["spec.devices[0]"]


def test_dra_slice_and_pool_names_are_one_per_pool_and_within_the_apis_limits():
    """Two resource names that read alike get two slice names; a node name of 253 characters
    still gives a pool name, and slices, the API server takes."""
    names = {gp.dra_slice_name("node-1", DRIVER, name, 0) for name in ("example.com/foo-bar", "example.com-foo/bar")}
    assert len(names) == 2
    longest = "n" * 253  # a node name is a DNS subdomain: this is one
    pools = {gp.dra_pool_name(longest, name) for name in ("example.com/gopher", "example.com/other")}
    assert len(pools) == 2
    assert all(len(pool) <= 253 for pool in pools)
    resource = gp.resource_config("example.com/" + "g" * 50)
    devices = {f"g{i}": gp.DeviceEntry(f"g{i}", f"/g/g{i}") for i in range(gp.DRA_MAX_DEVICES_PER_SLICE + 1)}
    for node in ("node-1", longest):
        slices = gp.resource_slices(DRIVER, node, resource, devices, 1)
        assert [standins.resource_slice_causes(item) for item in slices] == [[], []]
        assert all(len(item["metadata"]["name"]) <= 253 for item in slices)


def test_dra_api_server_stand_in_refuses_slices_as_the_real_one_does():
    """The checks of pkg/apis/resource/validation/validation.go a driver can fail, with the field
    errors' own wording (k8s.io/apimachinery field.Error)."""
    (resource,) = gp.parse_config(dra_config("/g", "/k")).resources
    (item,) = gp.resource_slices(DRIVER, "node-1", resource, {"g0": gp.DeviceEntry("g0", "/g/g0")}, 1)
    too_many = json.loads(json.dumps(item))
    too_many["spec"]["devices"] = [{"name": f"d{i}"} for i in range(129)]
    assert standins.resource_slice_causes(too_many) == [
        {
            "reason": "FieldValueTooMany",
            "message": "Too many: 129: must have at most 128 items",
            "field": "spec.devices",
        }
    ]
    too_long = json.loads(json.dumps(item))
    too_long["spec"]["pool"]["name"] = "n" * 240 + "/example.com/gopher"
    assert standins.resource_slice_causes(too_long) == [
        {"reason": "FieldValueTooLong", "message": "Too long: must have at most 253 bytes", "field": "spec.pool.name"}
    ]
    moved = json.loads(json.dumps(item))
    moved["spec"]["pool"]["name"] = "node-1/example.com/other"
    causes = standins.resource_slice_causes(moved, item)
    assert causes == [
        {
            "reason": "FieldValueInvalid",
            "message": 'Invalid value: "node-1/example.com/other": field is immutable',
            "field": "spec.pool.name",
        }
    ]
    name = item["metadata"]["name"]
    assert standins._invalid("ResourceSlice", "resource.k8s.io", name, causes) == {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": f'ResourceSlice.resource.k8s.io "{name}" is invalid: spec.pool.name: Invalid value: '
        '"node-1/example.com/other": field is immutable',
        "reason": "Invalid",
        "code": 422,
        "details": {"name": name, "group": "resource.k8s.io", "kind": "ResourceSlice", "causes": causes},
    }


def test_dra_api_server_stand_in_refuses_taints_as_the_real_one_does():
    """validateDeviceTaint: the key a label name, the value a label value, the effect one the API
    knows; at most 16 taints a device, at most 64 devices in a slice with a taint."""
    (resource,) = gp.parse_config(dra_config("/g", "/k")).resources
    sick = gp.DeviceEntry("g0", "/g/g0", health=gp.UNHEALTHY, problem="gone")
    (item,) = gp.resource_slices(DRIVER, "node-1", resource, {"g0": sick}, 1)
    assert item["spec"]["devices"][0]["taints"] == [
        {"key": f"{DRIVER}/unhealthy", "value": "gone", "effect": "NoSchedule"}
    ]
    assert standins.resource_slice_causes(item) == []

    def causes(**taint):
        bad = json.loads(json.dumps(item))
        bad["spec"]["devices"][0]["taints"] = [{"key": f"{DRIVER}/unhealthy", "effect": "NoSchedule", **taint}]
        return [(cause["field"], cause["reason"]) for cause in standins.resource_slice_causes(bad)]

    where = "spec.devices[0].taints[0]"
    assert causes(key="Not A Key") == [(f"{where}.key", "FieldValueInvalid")]
    assert causes(key="Example.COM/unhealthy") == [(f"{where}.key", "FieldValueInvalid")]  # no DNS prefix
    assert causes(key=f"{DRIVER}/" + "k" * 64) == [(f"{where}.key", "FieldValueInvalid")]
    assert causes(value="file is gone") == [(f"{where}.value", "FieldValueInvalid")]
    assert causes(value="v" * 64) == [(f"{where}.value", "FieldValueInvalid")]
    assert causes(value="") == []  # a taint needs no value
    assert causes(effect="PreferNoSchedule") == [(f"{where}.effect", "FieldValueNotSupported")]
    assert causes(effect="") == [(f"{where}.effect", "FieldValueRequired")]
    assert causes(effect="NoExecute") == []
    many = json.loads(json.dumps(item))
    many["spec"]["devices"][0]["taints"] *= 17
    assert [c["message"] for c in standins.resource_slice_causes(many)] == ["Too many: 17: must have at most 16 items"]
    crowded = json.loads(json.dumps(item))
    crowded["spec"]["devices"] += [{"name": f"d{i}"} for i in range(64)]
    assert [c["message"] for c in standins.resource_slice_causes(crowded)] == [
        "Too many: 65: must have at most 64 items"
    ]
    # The reason is the value only when it is a label value: a sentence is not
    long = dataclasses.replace(sick, problem="/g/g0 is a symlink to node0, which does not exist")
    assert gp.dra_unhealthy_taint(DRIVER, long)["value"] == gp.DRA_UNHEALTHY_TAINT_VALUE


def test_dra_api_server_stand_in_refuses_shared_devices_as_the_real_one_does():
    """validateDevice, validateRequestPolicy (slices), validateUID (results' shareID) and
    validateDeviceStatus (status entries by shareID) in kubernetes/kubernetes
    pkg/apis/resource/validation/validation.go."""
    (resource,) = gp.parse_config(dra_config("/g", "/k", replicas=4)).resources
    good = gp.resource_slices(DRIVER, "node-1", resource, {"g0": gp.DeviceEntry("g0", "/g/g0")}, 1)[0]

    def causes(**device_fields):
        item = json.loads(json.dumps(good))
        item["spec"]["devices"][0].update(device_fields)
        return [f"{c['field']}: {c['message']}" for c in standins.resource_slice_causes(item)]

    def policy(**fields):
        return {"shares": {"value": "4", "requestPolicy": fields}}

    at = "spec.devices[0].capacity[shares].requestPolicy"
    assert causes() == []
    assert causes(allowMultipleAllocations=False) == [f"{at}: Forbidden: allowMultipleAllocations must be true"]
    assert causes(allowMultipleAllocations=False, capacity={"shares": {"value": "4"}}) == []  # a plain capacity
    assert causes(capacity={"shares": {"value": "four"}}) == [
        'spec.devices[0].capacity[shares].value: Invalid value: "four"'
    ]
    assert causes(capacity=policy(default="1", validRange={"min": "1"}, validValues=["1"])) == [
        f'{at}: Forbidden: exactly one policy can be specified, cannot specify "validValues" and "validRange" at '
        "the same time"
    ]
    assert causes(capacity=policy(validRange={"min": "1"})) == [
        f"{at}.default: Required value: required when validRange is defined"
    ]
    assert causes(capacity=policy(default="1", validRange={"max": "4"})) == [
        f"{at}.validRange.min: Required value: required when validRange is defined"
    ]
    assert causes(capacity=policy(default="1", validRange={"min": "1", "max": "5", "step": "1"})) == [
        f'{at}.validRange.max: Invalid value: "5": max is larger than capacity value: 4'
    ]
    assert causes(capacity=policy(default="2", validRange={"min": "1", "max": "4", "step": "2"})) == [
        f'{at}.validRange.step: Invalid value: "2": value is not a multiple of a given step (2) from (1)',
        f'{at}.validRange.step: Invalid value: "4": value is not a multiple of a given step (2) from (1)',
    ]
    assert causes(capacity=policy(default="1", validRange={"min": "1", "step": "4"})) == [
        f'{at}.validRange.step: Invalid value: "4": one step 5 is larger than capacity value: 4'
    ]
    assert causes(capacity=policy(default="3", validValues=["2", "1"])) == [
        f'{at}.validValues[1]: Invalid value: "1": values must be sorted in ascending order',
        f'{at}.validValues: Invalid value: "3": default value is not valid according to the requestPolicy',
    ]
    assert causes(capacity={"1shares": {"value": "4"}})[0].startswith(
        'spec.devices[0].capacity[1shares]: Invalid value: "1shares": a valid C identifier'
    )
    crowded = {f"a{i}": {"int": i} for i in range(30)}
    assert causes(attributes=crowded, capacity={"b": {"value": "1"}, "c": {"value": "1"}, "d": {"value": "1"}}) == [
        "spec.devices[0]: Invalid value: 33: the total number of attributes and capacities must not exceed 32"
    ]
    # Results: a shareID is a lower-case UUID; status entries name theirs.
    api = standins.ApiServerSimulator()
    shared = ("gopher", DRIVER, DraNode.POOL, "g0", {"shareID": SHARE_1, "consumedCapacity": {"shares": "1"}})
    api.put_claim(claim("c1", "uid-1", shared))
    for bad in (SHARE_1.upper(), "share-1"):
        with pytest.raises(ValueError) as refused:
            api.put_claim(claim("c2", "uid-2", ("gopher", DRIVER, DraNode.POOL, "g0", {"shareID": bad})))
        assert str(refused.value) == (
            f'ResourceClaim.resource.k8s.io "c2" is invalid: status.allocation.devices.results[0].shareID: Invalid '
            f'value: "{bad}": uid must be in RFC 4122 normalized form, `xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` with '
            "lowercase hexadecimal characters"
        )
    stored = api.claims["default", "c1"]
    entry = {"driver": DRIVER, "pool": DraNode.POOL, "device": "g0"}
    assert standins.resource_claim_status_causes(stored, [{**entry, "shareID": SHARE_1}]) == []
    [unshared] = standins.resource_claim_status_causes(stored, [entry])  # the share is the allocated device
    assert unshared["message"] == (
        f'Invalid value: "{DRIVER}/{DraNode.POOL}/g0": must be an allocated device in the claim'
    )


@pytest.mark.slow
async def test_who_names_the_container_of_each_claims_device_in_a_dra_only_configuration(dra_node):
    """DRA: the kubelet lists, per container, the claims it names with each prepared device by
    driver, pool and device name; `who` (a subprocess with a DRA-only file, as in the DRA pod)
    finds the device of each. A claim of two devices: the kubelet gives the second one the first
    one's CDI device too, which must not make it the first device's holder twice."""
    for name in ("gopher0", "gopher1", "gopher2"):
        (dra_node.devices / name).touch()
    path = dra_node.root / "cfg.yaml"
    path.write_text(dra_config(dra_node.devices, dra_node.kubelet_dir, cdi=dra_node.cdi))
    with trio.fail_after(TIMEOUT):
        await dra_node.start(gp.load_config(str(path)))
        await dra_node.registered()
        await dra_node.wait_for_slices(["gopher0", "gopher1", "gopher2"])
        both = ("gopher", DRIVER, DraNode.POOL)
        dra_node.api.put_claim(claim("pair", "uid-pair", (*both, "gopher0"), (*both, "gopher2")))
        await dra_node.kubelet.prepare(DRIVER, [("default", "uid-pair", "pair")])
        dra_node.kubelet.use_claims("default", "trainer", "worker", [("default", "pair", "uid-pair")])
        socket_path = str(dra_node.kubelet_dir / "pod-resources" / "kubelet.sock")
        kubelet = dra_node.kubelet
        pod_resources = await dra_node.nursery.start(standins.PodResourcesSimulator(socket_path, None, kubelet).run)
        result = await trio.run_process(
            [sys.executable, str(HERE / "gopherplug.py"), "who", "--config", str(path)],
            env={**os.environ, "NODE_NAME": "node-1"},
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
        dra_node.stop()
    [listed] = pod_resources.pods()
    [dynamic] = listed.containers[0].dynamic_resources
    env = "example.com/gopher=uid-pair_gopher"  # the request's env, named with its first device
    assert [[c.name for c in r.cdi_devices] for r in dynamic.claim_resources] == [
        ["example.com/gopher=gopher0", env],
        ["example.com/gopher=gopher0", env, "example.com/gopher=gopher2"],  # as the kubelet fills them
    ]
    assert (result.returncode, result.stderr) == (0, b"")
    holder = "default/trainer/worker (claim default/pair)"
    assert result.stdout.decode().splitlines() == [
        f"example.com/gopher gopher0 {dra_node.devices / 'gopher0'}: Healthy: {holder}",
        f"example.com/gopher gopher1 {dra_node.devices / 'gopher1'}: Healthy: free",
        f"example.com/gopher gopher2 {dra_node.devices / 'gopher2'}: Healthy: {holder}",
    ]


async def test_dra_registers_and_devices_added_and_removed_reach_the_slices(dra_node):
    for name in ("gopher0", "gopher1"):
        (dra_node.devices / name).touch()
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.registered()
        await dra_node.wait_for_slices(["gopher0", "gopher1"])
        (dra_node.devices / "gopher2").touch()
        await dra_node.wait_for_slices(["gopher0", "gopher1", "gopher2"])
        (dra_node.devices / "gopher0").unlink()
        await dra_node.wait_for_slices(["gopher1", "gopher2"])
    assert dra_node.kubelet.events == [
        ("wiped", ""),  # the kubelet's start, before the driver was there
        ("registered", str(dra_node.kubelet_dir / f"plugins_registry/{DRIVER}-reg.sock")),
    ]
    assert dra_node.slice_devices()[1] == {3}  # a new generation per change
    assert [verb for verb, _ in dra_node.api.writes] == ["create", "update", "update"]


DESCRIBE_SCRIPT = """#!{python}
import json, os, sys, time
mode = open({mode!r}).read().strip()
if mode == "fail":
    print("starting", file=sys.stderr)
    print("nvidia-smi: command not found", file=sys.stderr)
    sys.exit(127)
if mode == "hang":
    print("waiting for the GPU", file=sys.stderr, flush=True)
    open({mode!r} + ".pid", "w").write(str(os.getpid()))
    os.execvp("sleep", ["sleep", "1000"])
if mode == "garbage":
    print("No devices were found")
    sys.exit(0)
ids = os.environ["GOPHERPLUG_DEVICES"].split(",")
print(json.dumps({{
    device_id: {{
        "attributes": {{"uuid": "GPU-" + device_id, "driverVersion": {{"version": "580.159.4"}}, "bad-name": 1}},
        "capacity": {{"memory": "143771Mi"}},
    }}
    for device_id in ids + ["gopher9"]
}}))
"""


def describe_script(root, mode="ok"):
    """A describe program (a real subprocess) whose behaviour ``mode`` chooses, as the file "mode" says."""
    (root / "mode").write_text(mode)
    script = root / "describe"
    script.write_text(DESCRIBE_SCRIPT.format(python=sys.executable, mode=str(root / "mode")))
    script.chmod(0o755)
    return str(script)


@pytest.mark.slow
async def test_dra_publishes_literal_file_and_described_attributes_and_capacity(dra_node, monkeypatch, caplog):
    """A resource's attributes and capacity, literal, from a file, and from describe (a real
    program, run once per scan of the resource, not per device), are in each device's ResourceSlice
    entry, which the strict API server takes; gopherplug's own attributes stay. A described value the
    API server would refuse ("bad-name") and a device describe names that the node has not are each
    one line, not a refused slice."""
    calls = described_calls(monkeypatch)
    info = dra_node.root / "info"
    for name, serial in (("gopher0", "A1"), ("gopher1", "B2")):
        (dra_node.devices / name).touch()
        (info / name).mkdir(parents=True)
        (info / name / "serial").write_text(serial + "\n")
    config = dra_node.config(
        attributes={
            "productName": "NVIDIA H200",
            "cores": 132,
            "ecc": True,
            "example.com/family": "hopper",
            "serial": {"file": str(info / "{id}" / "serial")},
        },
        capacity={"slots": 4, "hbm": "1.5Gi"},
        describe=[describe_script(dra_node.root)],
    )
    with trio.fail_after(TIMEOUT), caplog.at_level("INFO", logger="gopherplug"):
        await dra_node.start(config)
        await dra_node.registered()
        while not any("uuid" in d["attributes"] for s in dra_node.api.slices.values() for d in s["spec"]["devices"]):
            await dra_node.api.changed.wait_touched()
    assert calls.value == 1  # once for both devices
    devices = {d["name"]: d for s in dra_node.api.slices.values() for d in s["spec"]["devices"]}
    assert devices["gopher1"] == {
        "name": "gopher1",
        "attributes": {
            "resource": {"string": "example.com/gopher"},
            "id": {"string": "gopher1"},
            "healthy": {"bool": True},
            "productName": {"string": "NVIDIA H200"},
            "cores": {"int": 132},
            "ecc": {"bool": True},
            "example.com/family": {"string": "hopper"},
            "serial": {"string": "B2"},
            "driverVersion": {"version": "580.159.4"},
            "uuid": {"string": "GPU-gopher1"},
        },
        "capacity": {"slots": {"value": "4"}, "hbm": {"value": "1536Mi"}, "memory": {"value": "143771Mi"}},
    }
    assert devices["gopher0"]["attributes"]["serial"] == {"string": "A1"}
    refused = [line for line in caplog.messages if "bad-name" in line]
    assert refused == [
        f"example.com/gopher: device {name}: attributes.bad-name: not valid for the API server: 'bad-name' must be a "
        "C identifier (letters, digits and '_', not starting with a digit) of at most 32 characters"
        for name in ("gopher0", "gopher1")
    ]
    assert [line for line in caplog.messages if "gopher9" in line] == [
        f"example.com/gopher: describe {config.resources[0].describe[0]} described gopher9, which is not among the "
        "resource's devices"
    ]
    assert not [line for line in caplog.messages if "refused" in line or "422" in line]


@pytest.mark.slow
async def test_dra_a_failing_hanging_or_garbled_describe_leaves_the_devices_served_and_recovers(
    dra_node, monkeypatch, caplog
):
    """describe failing (with its stderr's last line), hanging (killed at the timeout) or
    printing garbage: the devices stay published, with what is known and nothing made up, each cause
    said in one line, once (a second run failing alike says nothing more). Fixed, the values appear
    without a restart (a failed describe is tried again), and that is said too."""
    # The timeout is short only while describe hangs: a Python program that fails or prints garbage
    # may take more than a second to start on a loaded machine, and must not be killed for it.
    monkeypatch.setattr(gp, "DESCRIBE_RETRY", (0.01, 0.01))
    calls = described_calls(monkeypatch)
    (dra_node.devices / "gopher0").touch()
    script = describe_script(dra_node.root, "fail")
    config = dra_node.config(attributes={"productName": "NVIDIA H200"}, describe=[script])

    def attributes():
        return [d["attributes"] for s in dra_node.api.slices.values() for d in s["spec"]["devices"]]

    async def runs(count):
        while calls.value < count:
            await calls.wait_touched()

    def said(text):
        return [line for line in caplog.messages if text in line]

    with trio.fail_after(TIMEOUT), caplog.at_level("INFO", logger="gopherplug"):
        await dra_node.start(config)
        await dra_node.registered()
        await dra_node.wait_for_slices(["gopher0"])
        await runs(2)  # failed twice: said once
        assert said("describe") == [
            f"example.com/gopher: describe {script} exited with 127: nvidia-smi: command not found (first: starting); "
            "the devices are offered without what it would say (0 keep what it said before)"
        ]
        assert attributes() == [
            {
                "resource": {"string": "example.com/gopher"},
                "id": {"string": "gopher0"},
                "healthy": {"bool": True},
                "productName": {"string": "NVIDIA H200"},
            }
        ]
        monkeypatch.setattr(gp, "DESCRIBE_TIMEOUT", 3.0)
        (dra_node.root / "mode").write_text("hang")
        await runs(calls.value + 2)
        assert said("did not finish") == [
            f"example.com/gopher: describe {script} did not finish within 3 s (killed): waiting for the GPU; the "
            "devices are offered without what it would say (0 keep what it said before)"
        ]
        monkeypatch.setattr(gp, "DESCRIBE_TIMEOUT", 10.0)
        (dra_node.root / "mode").write_text("garbage")
        await runs(calls.value + 2)
        assert said("printed no description") == [
            f"example.com/gopher: describe {script} printed no description: not JSON (Expecting value at line 1 "
            "column 1): 'No devices were found'; the devices are offered without what it would say (0 keep what it "
            "said before)"
        ]
        assert len(attributes()[0]) == 4  # nothing made up
        (dra_node.root / "mode").write_text("ok")
        while "uuid" not in attributes()[0]:
            await dra_node.api.changed.wait_touched()
        dra_node.stop()
    assert attributes()[0]["uuid"] == {"string": "GPU-gopher0"}
    assert said("works again") == [f"example.com/gopher: describe {script} works again: 1 device described"]
    with pytest.raises(ProcessLookupError):  # the hanging one was killed (and reaped), not left behind
        os.kill(int((dra_node.root / "mode.pid").read_text()), 0)
