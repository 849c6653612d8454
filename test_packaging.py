"""The module as users run it, and the package they install."""

from __future__ import annotations

import importlib.util
import inspect
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
import uuid
import zipfile
from pathlib import Path

import pytest
import trio
import trio.socket
import trio.testing
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import gopherplug as gp
import gopherplug_standins as standins
from testsupport import (
    HERE,
    RESOURCE,
    TIMEOUT,
    lock,
    read_until,
)

# ------------------------------------------------------------------------------------------------
# The module as users run it
# ------------------------------------------------------------------------------------------------


#: What only tests need, made unimportable for the module copied alone: the images have none of it.
TEST_ONLY_MODULES = (
    "grpc",
    "grpc_tools",
    "pytest",
    "test_gopherplug",
    "testsupport",
    "runtimesupport",
    "conftest",
    "gopherplug_standins",
    "celpy",
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv, last_line",
    [
        (["--version"], f"gopherplug {gp.__version__}"),
        (["demo"], "done: plugin stopped, its sockets removed"),
        (["demo", "--dra"], "done: plugin stopped, its sockets removed"),
    ],
    ids=["version", "demo", "dra-demo"],
)
def test_module_copied_alone_runs(tmp_path, sockdir, argv, last_line):
    """gopherplug.py is what users copy into an image: alone, with only the runtime dependencies
    (and the dra extra for the DRA demo), it runs, and both demos run without the stand-ins that
    only tests need (gopherplug_standins, cel-python)."""
    shutil.copy(HERE / "gopherplug.py", tmp_path / "gopherplug.py")
    script = (
        "import sys, runpy\n"
        f"for name in {TEST_ONLY_MODULES!r}: sys.modules[name] = None\n"
        f"sys.argv = ['gopherplug.py', *{argv!r}]\n"
        "runpy.run_path('gopherplug.py', run_name='__main__')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"TMPDIR": sockdir}
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.rstrip("\n").endswith(last_line), result.stdout


@pytest.mark.slow
def test_the_one_file_build_is_the_same_twice_and_runs_with_nothing_installed(tmp_path, sockdir):
    """.ci/zipapp's archive (docs/deployment.md, "One file"): two builds give the same bytes; it
    holds no extension module and gives every module its bytecode; and an interpreter that sees
    nothing installed (-S: no site-packages; -I: no PYTHONPATH, no user site) runs check-config and
    the demo from it alone, on protobuf's pure-Python implementation, with no warning about it, and
    with gopherplug's code from the archive's bytecode (compiled at build time under its name in
    the archive; the zip importer, compiling the source, would name the archive's path)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"SOURCE_DATE_EPOCH": "1700000000"}
    built = []
    for name in ("one.pyz", "two.pyz"):
        result = subprocess.run(
            [sys.executable, str(HERE / ".ci" / "zipapp"), str(tmp_path / name)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 0, result.stderr
        built.append((tmp_path / name).read_bytes())
    assert built[0] == built[1]
    archive = tmp_path / "one.pyz"
    with zipfile.ZipFile(archive) as opened:
        names = set(opened.namelist())
    assert not [name for name in names if name.endswith(".so")]
    assert {"__main__.py", "gopherplug.py", "google/protobuf/__init__.py", "yaml/__init__.py"} <= names
    assert not [name for name in names if name.endswith(".py") and name + "c" not in names]
    devices = tmp_path / "dev"
    devices.mkdir()
    (devices / "g0").touch()
    (devices / "g1").touch()
    config = tmp_path / "config.yaml"
    config.write_text(f"device_plugin_dir: {sockdir}\nresources:\n  - name: {RESOURCE}\n    directory: {devices}\n")
    alone = [sys.executable, "-I", "-S"]
    env.pop("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION", None)
    for argv, last_line in (
        (["check-config", "--config", str(config)], f"{RESOURCE}: 2 devices, 2 healthy, from {devices}/*"),
        (["demo"], "done: plugin stopped, its sockets removed"),
    ):
        result = subprocess.run(
            [*alone, str(archive), *argv], env=env | {"TMPDIR": sockdir}, capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stderr
        assert last_line in result.stdout, result.stdout
        # protobuf's warning when it falls back from upb ("Selected implementation upb is not
        # available. Falling back to the python implementation.") would be here.
        assert "implementation" not in result.stderr and "Traceback" not in result.stderr, result.stderr
    probe = (
        f"import runpy, sys; sys.argv[1:] = ['--version']\n"
        f"try: runpy.run_path({str(archive)!r}, run_name='__main__')\n"
        "except SystemExit: pass\n"
        "from google.protobuf.internal import api_implementation; import gopherplug, os, yaml\n"
        "print(api_implementation.Type(), yaml.__with_libyaml__, gopherplug.main.__code__.co_filename,\n"
        "      os.environ.get('PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION'))\n"
    )
    result = subprocess.run([*alone, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"gopherplug {gp.__version__}", "python False gopherplug.py None"]


async def _serving_rss(argv, cwd, env, sockdir):
    """Start ``argv serve`` on a node without a kubelet yet; once it says it waits for one (its
    start is over), the OS's word on the process: its VmRSS in MiB and its command line."""
    plugin_dir = os.path.join(sockdir, "dp")
    os.makedirs(plugin_dir, exist_ok=True)
    config = Path(cwd, "config.yaml")
    config.write_text(f"device_plugin_dir: {plugin_dir}\nresources:\n  - name: {RESOURCE}\n    directory: {cwd}\n")
    command = [*argv, "serve", "--config", str(config), "--log-level", "info"]
    process = await trio.lowlevel.open_process(command, cwd=cwd, env=env, stderr=subprocess.PIPE)
    try:
        with trio.fail_after(TIMEOUT * 3):
            await read_until(process.stderr, "waiting for the kubelet", bytearray())
        status = Path(f"/proc/{process.pid}/status").read_text()
        rss = int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024
        return rss, Path(f"/proc/{process.pid}/cmdline").read_bytes().split(b"\0")
    finally:
        process.kill()
        await process.wait()


@pytest.mark.slow
async def test_a_copy_started_as_a_script_keeps_no_compiler_memory(tmp_path, sockdir):
    """`python gopherplug.py serve` from a copy without bytecode (a read-only image) costs what an
    install with bytecode costs, within 4 MiB: CPython would keep the script's syntax tree (about
    18 MiB) for the whole run, so the script starts again as an import in the same process; and
    what compiling it freed goes back to the kernel (about 10 MiB that glibc would keep)."""
    copy = tmp_path / "gopherplug.py"
    shutil.copy(HERE / "gopherplug.py", copy)
    bare = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")}
    imported = [sys.executable, "-c", "import sys, gopherplug; sys.exit(gopherplug.main())"]
    compiled = subprocess.run([sys.executable, "-m", "compileall", "-q", str(copy)], env=bare, check=False)
    assert compiled.returncode == 0
    reference, _ = await _serving_rss(imported, tmp_path, bare, sockdir)
    shutil.rmtree(tmp_path / "__pycache__")
    no_bytecode = bare | {"PYTHONDONTWRITEBYTECODE": "1"}
    script, cmdline = await _serving_rss([sys.executable, str(copy)], tmp_path, no_bytecode, sockdir)
    compiled_at_start, _ = await _serving_rss(imported, tmp_path, no_bytecode, sockdir)
    assert not (tmp_path / "__pycache__").exists()
    # The same process (its PID), now running the file as an imported module (-P: the current
    # directory kept off sys.path).
    assert cmdline[1:3] == [b"-P", b"-c"] and f"{str(copy)!r}".encode() in cmdline[3], cmdline
    assert cmdline[4:6] == [b"serve", b"--config"], cmdline
    assert script < reference + 4, (script, reference)
    assert compiled_at_start < reference + 4, (compiled_at_start, reference)


#: The environment a user's shell gives `python anyname.py`: no PYTHONPATH of the test run's, no
#: safe-path, bytecode written as usual.
SCRIPT_ENV = {
    k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH", "PYTHONDONTWRITEBYTECODE")
}


def _marked_copy(path):
    """gopherplug.py copied to ``path``, its ``__version__`` made a marker of its own followed by the
    sys.path it runs with: `--version` then tells which code ran (this copy's, or an installed
    gopherplug's) and where it looks for modules. The marker, and a probe script beside the copy
    that prints what a script in its place gets: what the copy's `--version` must print."""
    marker = f"copy-{uuid.uuid4().hex[:12]}"
    source = (HERE / "gopherplug.py").read_text()
    marked = re.sub(
        r'^__version__ = ".*"$',
        f'__version__ = "{marker} " + __import__("os").pathsep.join(__import__("sys").path)',
        source,
        count=1,
        flags=re.M,
    )
    assert marked != source
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(marked)
    probe = path.parent / "probe_sys_path.py"
    probe.write_text("import os, sys\nprint(os.pathsep.join(sys.path))\n")
    return marker, probe


def _assert_ran_the_copy(result, marker, sys_path):
    """``result`` is the marked copy's `--version`, run with ``sys_path`` (argparse wraps the line
    to the terminal's width: compared without white space)."""
    said, expected = ("".join(text.split()) for text in (result.stdout, f"gopherplug {marker} {sys_path}"))
    assert (result.returncode, said) == (0, expected), result.stderr


def _run_python(args, cwd, env=SCRIPT_ENV):
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["anyname.py", "anyname"])
def test_a_copy_under_another_name_runs_its_own_code_with_a_scripts_sys_path(tmp_path, name):
    """`python anyname.py` runs that file, not the gopherplug installed in this test's venv (which
    an `import gopherplug` would find), with the sys.path Python gives a script there, and caches
    its bytecode beside it as an import would."""
    copy = tmp_path / "app" / name
    marker, probe = _marked_copy(copy)
    (tmp_path / "elsewhere").mkdir()
    for options in ([], ["-P"]):  # -P: not even the script's own directory on sys.path
        result = _run_python([*options, str(copy), "--version"], tmp_path / "elsewhere")
        expected = _run_python([*options, str(probe)], tmp_path / "elsewhere").stdout.strip()
        _assert_ran_the_copy(result, marker, expected)
        assert (expected.split(os.pathsep)[0] == str(copy.parent)) == (not options), expected
    assert Path(importlib.util.cache_from_source(str(copy))).is_file()


@pytest.mark.slow
def test_a_symlink_to_a_copy_runs_the_copy_with_the_resolved_files_directory_on_sys_path(tmp_path):
    """A link to the copy (in a bin directory, say) runs the copy's code, with the directory
    CPython gives a script reached through a link: the linked file's."""
    copy = tmp_path / "opt" / "anyname.py"
    marker, probe = _marked_copy(copy)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "gp.py").symlink_to(copy)
    (tmp_path / "bin" / "probe.py").symlink_to(probe)
    expected = _run_python(["probe.py"], tmp_path / "bin").stdout.strip()
    result = _run_python(["gp.py", "--version"], tmp_path / "bin")
    _assert_ran_the_copy(result, marker, expected)
    assert expected.split(os.pathsep)[0] == str(copy.parent), expected  # CPython's rule: the target's directory


@pytest.mark.slow
def test_a_copy_never_runs_an_older_gopherplug_found_on_sys_path(tmp_path):
    older = tmp_path / "older" / "gopherplug.py"
    older.parent.mkdir()
    older.write_text('print("WRONG")\nraise SystemExit(3)\n')
    copy = tmp_path / "app" / "newer.py"  # not copy.py: that would be the stdlib `copy`
    marker, probe = _marked_copy(copy)
    env = SCRIPT_ENV | {"PYTHONPATH": str(older.parent)}
    expected = _run_python([str(probe)], tmp_path, env).stdout.strip()
    result = _run_python([str(copy), "--version"], tmp_path, env)
    assert "WRONG" not in result.stdout
    _assert_ran_the_copy(result, marker, expected)


@pytest.mark.slow
def test_a_copy_run_as_a_script_imports_nothing_from_the_current_directory(tmp_path):
    """The current directory is not the script's: a `yaml.py` or `trio.py` left there (by anyone
    who can write to it) is never imported by `python /path/to/gopherplug.py`, often run as root."""
    copy = tmp_path / "app" / "gopherplug.py"
    marker, probe = _marked_copy(copy)
    hostile = tmp_path / "hostile"
    hostile.mkdir()
    for name in ("yaml", "trio"):
        (hostile / f"{name}.py").write_text(f"open({str(hostile / f'imported-{name}')!r}, 'w').close()\n")
    expected = _run_python([str(probe)], hostile).stdout.strip()
    result = _run_python([str(copy), "--version"], hostile)
    assert sorted(path.name for path in hostile.glob("imported-*")) == []
    _assert_ran_the_copy(result, marker, expected)


@pytest.mark.slow
def test_a_copy_run_as_a_script_is_compiled_once_unless_it_just_changed(tmp_path):
    """The script's process hands the code it compiled to the import it starts again as: where no
    bytecode is cached (a read-only copy), the file is not compiled a second time (about 350 ms for
    this file). A file changed in the last 2 s may have changed since the interpreter read it: it is
    compiled again from the disk. Each compile of the copy is counted by an audit hook."""
    copy = tmp_path / "app" / "anyname.py"
    marker, _ = _marked_copy(copy)
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(
        "import sys\n"
        "def hook(event, args):\n"
        "    if event == 'compile' and str(args[1]).endswith('anyname.py'):\n"
        "        print('compiled', args[1], file=sys.stderr)\n"
        "sys.addaudithook(hook)\n"
    )
    env = SCRIPT_ENV | {"PYTHONPATH": str(hooks), "PYTHONDONTWRITEBYTECODE": "1"}
    compiles = {}
    for age in (0, 60):
        now = time.time()
        os.utime(copy, (now - age, now - age))
        result = _run_python([str(copy), "--version"], tmp_path, env)
        assert result.returncode == 0 and marker in result.stdout, result.stderr
        compiles[age] = result.stderr.count("compiled ")
    assert compiles == {0: 2, 60: 1}, compiles  # the first: the interpreter's, running the script
    assert not (copy.parent / "__pycache__").exists()


def test_the_product_module_carries_none_of_the_test_only_stand_ins():
    """The line between the product and its stand-ins: what gopherplug_standins defines itself
    (validation, the strict API server, the scheduler) is nowhere in gopherplug, and the Dockerfile
    copies gopherplug.py alone into the images."""
    extended = {"DraKubeletSimulator", "PodResourcesSimulator"}  # the product's, with what tests need added
    test_only = set(standins.__all__) - {"KubeletSimulator", "UnexpectedAdmissionError", *extended}
    assert {"ApiServerSimulator", "SchedulerSimulator", "resource_slice_causes"} <= test_only
    assert [name for name in sorted(test_only) if hasattr(gp, name)] == []
    # The kubelet stand-ins are the product's (the demo runs them); the tests' DRA kubelet adds to it.
    assert standins.KubeletSimulator is gp.KubeletSimulator
    assert all(issubclass(getattr(standins, name), getattr(gp, name)) for name in extended)
    source = (HERE / "gopherplug.py").read_text()
    assert "celpy" not in source
    assert "gopherplug_standins" not in re.findall(r"^(?:import|from) (\S+)", source, re.M)
    copies = [line for line in (HERE / "Dockerfile").read_text().splitlines() if line.startswith("COPY ")]
    assert not [line for line in copies if "standins" in line]


def test_the_public_api_is_all_the_readme_and_the_docstring_alike():
    """__all__ is the contract: the module's docstring and docs/embedding.md's "The public API" list the
    same names, each of them exists, says what it is, and (for a function) types every parameter."""
    docstring = gp.__doc__.split("The public API is __all__", 1)[1].split("Quick start:", 1)[0]
    table = docstring.split("\n\n", 1)[1]
    in_docstring = re.findall(r"[A-Za-z_][A-Za-z0-9_]*", " ".join(line[21:] for line in table.splitlines()))
    readme = (HERE / "docs" / "embedding.md").read_text()
    section = readme.split("## The public API", 1)[1].split("\n## ", 1)[0]
    in_readme = re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", section.split("| --- | --- |", 1)[1])
    assert sorted(in_docstring) == sorted(in_readme) == sorted(gp.__all__)
    assert len(set(gp.__all__)) == len(gp.__all__)
    for name in gp.__all__:
        value = getattr(gp, name)
        if inspect.isfunction(value) or inspect.isclass(value):
            assert inspect.getdoc(value), f"{name} has no docstring"
        if inspect.isfunction(value):
            signature = inspect.signature(value)
            untyped = [p.name for p in signature.parameters.values() if p.annotation is inspect.Parameter.empty]
            assert not untyped and signature.return_annotation is not inspect.Signature.empty, name


def test_main_version(capsys):
    assert gp.main(["--version"]) == 0
    assert capsys.readouterr().out == f"gopherplug {gp.__version__}\n"


# ------------------------------------------------------------------------------------------------
# The package: a version pip reads without the module, ranges for embedders, locks for images
# ------------------------------------------------------------------------------------------------


def project_table():
    return tomllib.loads((HERE / "pyproject.toml").read_text())["project"]


def test_the_package_version_is_the_module_version():
    assert project_table()["version"] == gp.__version__


@pytest.mark.parametrize(
    ("lock_name", "extras"),
    [("device-plugin.lock", ["metrics"]), ("dra.lock", ["dra", "metrics"]), ("test.lock", ["test", "dra", "metrics"])],
)
def test_ranges_for_embedders_exact_versions_with_hashes_in_the_locks(lock_name, extras):
    """The wheel declares ranges (a lower bound CI tests, below the next major), never a pin, so
    that it installs beside an embedder's own versions; each lock pins, with hashes, versions
    inside those ranges. The test extra's tools are pinned on purpose (pyproject.toml says why)."""
    project = project_table()
    wheel = [
        *project["dependencies"],
        *project["optional-dependencies"]["dra"],
        *project["optional-dependencies"]["metrics"],
    ]
    for requirement in map(Requirement, wheel):
        operators = sorted(spec.operator for spec in requirement.specifier)
        assert operators == ["<", ">="], f"{requirement}: a range from a tested version to the next major"
    pins = lock(lock_name)
    declared = [*project["dependencies"], *(r for extra in extras for r in project["optional-dependencies"][extra])]
    for requirement in map(Requirement, declared):
        name = canonicalize_name(requirement.name)
        if name == "gopherplug":
            continue
        assert name in pins, f"{lock_name} lacks {name}"
        assert requirement.specifier.contains(pins[name][0]), (
            f"{lock_name}: {name} {pins[name][0]} not in {requirement}"
        )
    assert pins["purerpc"][0].release[:2] == (0, 8)
    assert pins["h2"][0].major == 4, "the images run the current h2 (requirements/overrides.txt)"


def test_beside_grpclib_and_httpx_in_one_process(sockdir):
    """An embedder's own HTTP/2 stack works in the process that imported gopherplug: grpclib serves
    and calls gRPC health checks, and httpx (HTTP/2 with prior knowledge) calls the same server.
    CI's "beside" venv runs this with h2 4.4.1 (.ci/run); where they are not installed, it skips."""
    asyncio = pytest.importorskip("asyncio")
    grpclib_server = pytest.importorskip("grpclib.server")
    grpclib_client = pytest.importorskip("grpclib.client")
    health = pytest.importorskip("grpclib.health.service")
    health_pb2 = pytest.importorskip("grpclib.health.v1.health_pb2")
    health_grpc = pytest.importorskip("grpclib.health.v1.health_grpc")
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("h2")
    path = os.path.join(sockdir, "grpclib.sock")

    async def exchange():
        server = grpclib_server.Server([health.Health()])
        await server.start(path=path)
        try:
            async with grpclib_client.Channel(path=path) as channel:
                checked = await health_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT)
            transport = httpx.AsyncHTTPTransport(uds=path, http1=False, http2=True)
            async with httpx.AsyncClient(transport=transport, timeout=TIMEOUT) as client:
                answer = await client.post(
                    "http://localhost/grpc.health.v1.Health/Check",
                    content=b"\0\0\0\0\0",  # one uncompressed, empty HealthCheckRequest
                    headers={"content-type": "application/grpc", "te": "trailers"},
                )
        finally:
            server.close()
            await server.wait_closed()
        return checked, answer

    checked, answer = asyncio.run(exchange())
    assert checked.status == health_pb2.HealthCheckResponse.SERVING
    assert (answer.http_version, answer.status_code) == ("HTTP/2", 200)
    assert health_pb2.HealthCheckResponse.FromString(answer.content[5:]).status == checked.status


@pytest.mark.slow
def test_python_before_3_11_is_refused_by_pip_in_one_line(tmp_path):
    """pip reads the version and Requires-Python without running setuptools over gopherplug.py,
    whose syntax (except*) a Python 3.10 cannot parse: pip's own refusal, not a traceback."""
    candidates = [*sorted(map(str, Path.home().glob(".pyenv/versions/3.10.*/bin/python"))), shutil.which("python3.10")]
    python = next((c for c in candidates if c and python_version(c)), None)
    if python is None:
        pytest.skip("no Python 3.10 on this machine")
    source = tmp_path / "src"
    shutil.copytree(HERE, source, ignore=shutil.ignore_patterns(".venv*", ".git", "__pycache__", "build", "*.egg-info"))
    result = subprocess.run(
        [python, "-m", "pip", "install", "--dry-run", "--no-deps", str(source)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    errors = [line for line in result.stderr.splitlines() if line.startswith("ERROR")]
    assert result.returncode != 0
    assert errors == [
        f"ERROR: Package 'gopherplug' requires a different Python: {python_version(python)} not in '>=3.11'"
    ]
    assert "Traceback" not in result.stdout + result.stderr


def python_version(python):
    """The version of the interpreter at ``python``, or None where it does not run (a pyenv shim of
    a version not selected)."""
    found = subprocess.run(
        [python, "-c", "import platform; print(platform.python_version())"], capture_output=True, text=True, check=False
    )
    return found.stdout.strip() if found.returncode == 0 else None
