"""What a learner and a user meet beside the product: the CEL selectors as an installable extra
(gopherplug_cel, with no circle between the product and its stand-ins), CEL's equality as cel-go
has it, the lessons' exercise checkers against wrong answers, and the narrating kubelet's
admission."""

import ast
import os
import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest
import trio

import gopherplug as gp
from testsupport import HERE, RESOURCE, TIMEOUT, hailo_config, start

# ------------------------------------------------------------------------------------------------
# No circle: the product, its CEL module and the stand-ins
# ------------------------------------------------------------------------------------------------


def imported_modules(path, top_level_only=False):
    """The modules ``path`` imports (``from X import`` and ``import X``), anywhere in it or only
    at its top level (what runs as the module is imported)."""
    tree = ast.parse(Path(path).read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    names = set()
    for statement in nodes:
        if isinstance(statement, ast.ImportFrom) and statement.module:
            names.add(statement.module.split(".")[0])
        elif isinstance(statement, ast.Import):
            names.update(alias.name.split(".")[0] for alias in statement.names)
    return names


@pytest.mark.slow
def test_the_product_imports_nothing_of_the_stand_ins_which_import_the_product():
    """The stand-ins depend on the product, never the other way round: gopherplug.py imports no
    test module, not even inside a function (demo --select takes its CEL from gopherplug_cel), and
    gopherplug_cel imports no gopherplug as it is imported, so that gopherplug may import it where
    a selector is given with no circle."""
    product = imported_modules(HERE / "gopherplug.py")
    assert "gopherplug_standins" not in product
    assert "gopherplug_cel" in product  # where a selector is given: demo_selector
    assert "gopherplug_cel" not in imported_modules(HERE / "gopherplug.py", top_level_only=True)
    assert (
        imported_modules(HERE / "gopherplug_cel.py", top_level_only=True)
        & {
            "gopherplug",
            "gopherplug_standins",
            "celpy",
        }
        == set()
    )
    assert {"gopherplug", "gopherplug_cel"} <= imported_modules(HERE / "gopherplug_standins.py", top_level_only=True)


#: What the wheel is built from (pyproject.toml's py-modules, its readme and licence).
WHEEL_SOURCES = (
    "pyproject.toml",
    "README.md",
    "LICENSE",
    "gopherplug.py",
    "gopherplug_cel.py",
    "gopherplug_standins.py",
)


@pytest.mark.slow
def test_a_fresh_venv_with_the_dra_and_cel_extras_runs_demo_select(tmp_path, sockdir):
    """`pip install '.[dra,cel]'` is all a user types for `demo --dra --select`: in a
    fresh venv, the project installed with those extras from a copy of its sources (pip resolves
    the extras' dependencies from the index), the console script evaluates a selector on the
    devices of a configuration and allocates the device it selects. gopherplug_cel is in the
    wheel, and cel-python comes with the extra, not with the test extra."""
    source = tmp_path / "src"
    source.mkdir()
    for name in WHEEL_SOURCES:
        shutil.copy(HERE / name, source / name)
    venv.create(tmp_path / "venv", with_pip=True)
    python = tmp_path / "venv" / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    install = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", f"{source}[dra,cel]"]
    result = subprocess.run(install, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr
    check = [str(python), "-c", "import celpy, gopherplug_cel, lightkube, h11; import grpc"]
    assert "No module named 'grpc'" in subprocess.run(check, capture_output=True, text=True, env=env).stderr
    selector = 'device.attributes["gopherplug.example.com"].firmwareVersion.isGreaterThan(semver("4.17.0"))'
    config = hailo_config(sockdir)
    script = tmp_path / "venv" / "bin" / "gopherplug"
    argv = [str(script), "demo", "--config", config, "--dra", "--select", selector]
    result = subprocess.run(
        argv, cwd=tmp_path, env=env | {"TMPDIR": sockdir}, capture_output=True, text=True, timeout=120
    )
    assert (result.returncode, result.stderr) == (0, ""), result.stdout
    assert "hailo0: not selected" in result.stdout and "hailo1: selected" in result.stdout
    assert "allocated a ResourceClaim: device hailo1 of pool demo-node/example.com/hailo" in result.stdout


# ------------------------------------------------------------------------------------------------
# CEL's equality, as cel-go has it
# ------------------------------------------------------------------------------------------------

ATTRIBUTE = 'device.attributes["gopherplug.example.com"]'


@pytest.mark.parametrize(
    "expression, expected",
    [
        ('"1" == 1', False),  # cel-python: "no such overload"
        ('"1" != 1', True),
        ("true == 1", False),  # cel-python: true (a bool is an int in Python)
        (f"{ATTRIBUTE}.index == 1", False),  # the string attribute "1"
        (f'{ATTRIBUTE}.index == "1"', True),
        (f"{ATTRIBUTE}.count == 1.0", True),  # an int and a double: by value
        ("1 == 1u", True),
        ("9007199254740993 == 9007199254740992.0", False),  # exactly, not as two doubles
        ('[1, "a"] == [1.0, "a"]', True),
        ('[1] == ["1"]', False),
        ('{"a": 1} == {"a": "1"}', False),
        ('{"a": 1} == {"a": 1u}', True),
        ("null == 0", False),
        ("null == null", True),
        ('1 in ["1", 1.0]', True),
        ('1 in ["1"]', False),
        ('"a" in {"a": 1}', True),
        ('semver("1.0.0+a") == semver("1.0.0+b")', True),  # build metadata is not compared
        ('quantity("1") == quantity("1000m")', True),
        ('1 == quantity("1")', False),  # an int's Equal: another type is unequal
        ('quantity("1") == 1', "no such overload"),  # Quantity's Equal: another type is no overload
        ('semver("1.0.0") == "1.0.0"', "no such overload"),
        (f"{ATTRIBUTE}.absent == 1", "no such key: absent"),  # an error is not false
    ],
)
def test_cel_equality_is_cel_gos_heterogeneous_equality(expression, expected):
    """==, != and `in` as cel-go evaluates them (cel-spec's heterogeneous equality, the default of
    cel-go; Equal of the Kubernetes library's Quantity and Semver), where cel-python differs:
    values of different types are unequal, not an error; numbers compare by value."""
    from gopherplug_cel import CELError, DeviceSelector, cel_device

    device = cel_device(
        "gopherplug.example.com", {"name": "g0", "attributes": {"index": {"string": "1"}, "count": {"int": 1}}}
    )
    selector = DeviceSelector(expression)
    if isinstance(expected, bool):
        assert selector.matches(device) is expected
    else:
        with pytest.raises(CELError) as error:
            selector.matches(device)
        assert error.value.message == expected


# ------------------------------------------------------------------------------------------------
# The narrating kubelet: admission as the kubelet's
# ------------------------------------------------------------------------------------------------


async def test_the_narrating_kubelet_fails_a_pod_that_finds_too_few_free_devices(nursery, node):
    """`gopherplug kubelet`'s allocate, for more devices than are free: the pod's admission fails for
    good, as the kubelet's device manager fails it (UnexpectedAdmissionError, in its words); it
    does not wait for a device, and the plugin is never asked."""
    said = []
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node)
        await gp.kubelet_request(simulator, f"allocate {RESOURCE} 3", lambda who, what: said.append((who, what)))
    message = (
        f"Allocate failed due to requested number of devices unavailable for {RESOURCE}. Requested: 3, Available: 2, "
        "which is unexpected"
    )
    ((who, what),) = said
    assert who == "kubelet"
    assert re.fullmatch(
        rf"pod default/pod-\d+ asks for 3 {RESOURCE}: UnexpectedAdmissionError: {re.escape(message)}", what
    )
    assert (simulator.rejections, simulator.pod_devices) == ([(RESOURCE, message)], {})


# ------------------------------------------------------------------------------------------------
# The exercises' checkers, against wrong answers
# ------------------------------------------------------------------------------------------------

LESSONS = HERE / "examples" / "lesson"

#: Wrong answers, each the reference solution with one mistake: (exercise, the solution's text, the
#: mistake put in its place, what the check must say: who saw what, and the hint's start).
WRONG_ANSWERS = {
    "opens-the-device": (
        2,
        "        try:\n            with open(os.path.join(self.lock_dir",
        "        os.close(os.open(os.path.join(self.directory, device_id), os.O_RDONLY | os.O_NONBLOCK))\n"
        "        try:\n            with open(os.path.join(self.lock_dir",
        "the kubelet saw: PreStartContainer(gopher0, gopher1) opened gopher0, gopher1, while",
        "hint: never open a device to find out whether it is busy",
    ),
    "pid-0-busy": (
        2,
        "        if pid <= 0:",
        "        if pid < 0:",
        "the kubelet saw: PreStartContainer(gopher0, gopher1) -> FAILED_PRECONDITION",
        "hint: os.kill(0, 0) asks about your own process group",
    ),
    "eperm-stale": (
        2,
        "        except PermissionError:\n            pass",
        "        except PermissionError:\n            return None",
        "the kubelet saw: PreStartContainer(gopher0, gopher1) -> OK, while LCK..gopher1 names process 1 (alive, "
        "another user's)",
        "hint: os.kill(pid, 0) raising PermissionError (EPERM) says the process exists",
    ),
    "numa-a-string": (
        3,
        '{"int": gopher.numa}',
        '{"string": str(gopher.numa)}',
        "the scheduler saw: gopher1's numaNode {'string': '1'}",
        'hint: publish it as an int ({"int": ...})',
    ),
    "unknown-numa-as-0": (
        3,
        '        if gopher.numa is not None:\n            attributes["numaNode"] = {"int": gopher.numa}',
        '        attributes["numaNode"] = {"int": gopher.numa or 0}',
        "the scheduler saw: gopher4, whose NUMA node is unknown (its file has no numa line), with numaNode {'int': 0}",
        "hint: publish numaNode only where the node is known",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("mistake", WRONG_ANSWERS)
def test_an_exercise_check_fails_a_wrong_answer_with_a_hint(tmp_path, sockdir, mistake):
    """Each exercise's check against a wrong answer (its reference solution with one mistake, applied
    to a copy of the lessons as `check.py --solution` applies it): not passed, what the kubelet or
    the scheduler saw and a hint for that mistake, never a traceback. Exercise 2: a check that
    opens the device (the exercise says never: the check watches the gophers with inotify), a lock
    naming pid 0 taken as held (kill(0, 0) asks about the process group), a live process of another
    user (EPERM) taken as gone; exercise 3: numaNode published as a string, and as 0 for a gopher
    whose node is unknown."""
    number, right, wrong, saw, hint = WRONG_ANSWERS[mistake]
    copy = tmp_path / "lesson"
    shutil.copytree(LESSONS, copy, ignore=shutil.ignore_patterns("__pycache__"))
    solution = copy / "solutions" / f"exercise{number}.py"
    text = solution.read_text()
    assert text.count(right) == 1, right
    solution.write_text(text.replace(right, wrong))
    env = {**os.environ, "PYTHONPATH": str(HERE), "TMPDIR": sockdir}
    check = [sys.executable, str(copy / "check.py"), "--solution", str(number)]
    result = subprocess.run(check, env=env, capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stderr) == (1, ""), result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"exercise {number}: not yet.", result.stdout
    assert lines[1].startswith(f"  {saw}"), result.stdout
    assert lines[2].startswith(f"  {hint}"), result.stdout
    assert len(lines) == 3, result.stdout
