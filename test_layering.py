"""The module's map is true: every section of gopherplug.py uses only itself and those above it.

The docstring says "every section only uses the ones above it" and each section's banner writes its
rules; this reads the module with ast and checks what can be checked: every run-time reference
(annotations aside: they are never evaluated, the module has `from __future__ import annotations`)
goes from a section to itself or one above, the pure core has no coroutine, no logging call and
no file opened for writing, every exception gopherplug raises is in section 2 (Errors), and the lettered
sub-sections of the big sections are each named in the docstring's map.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

MODULE = Path(__file__).with_name("gopherplug.py")

#: A section's banner: a line of #, then "# N. Title"; a sub-section's: one line, "# Na. Title ----".
_SECTION = re.compile(r"^# (\d+)\. (.+)$")
_SUBSECTION = re.compile(r"^# (\d+)([a-z])\. (.+?) -{3,}$")
_RULE = re.compile(r"^#{20,}$")

#: The pure core's section and the exceptions' section, as the map numbers them.
PURE_CORE, ERRORS = 4, 2

#: Calls that write to the file system, by their dotted name: the pure core makes none.
_WRITERS = frozenset(
    {"os.replace", "os.rename", "os.unlink", "os.remove", "os.fsync", "os.mkdir", "os.makedirs", "shutil.rmtree"}
)
_LOGGING = frozenset({"debug", "info", "warning", "error", "exception", "critical", "log"})


@dataclass(frozen=True)
class Banner:
    line: int  # 1-based line of the title
    number: int
    letter: str  # "" for a section
    title: str


def banners(lines: list[str]) -> list[Banner]:
    """The section and sub-section banners, in order."""
    found = []
    for index, text in enumerate(lines[1:], start=1):
        if match := _SUBSECTION.match(text):
            found.append(Banner(index + 1, int(match[1]), match[2], match[3]))
        elif (match := _SECTION.match(text)) and _RULE.match(lines[index - 1]):
            found.append(Banner(index + 1, int(match[1]), "", match[2]))
    return found


def section_of(line: int, sections: list[Banner]) -> Banner | None:
    """The (sub-)section a line is in; None above section 1 (the imports and the logging helpers)."""
    current = None
    for banner in sections:
        if banner.line > line:
            break
        current = banner
    return current


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _annotations(tree: ast.AST) -> set[int]:
    """The ids of every node inside an annotation: never evaluated at run time."""
    roots: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            arguments = node.args
            every = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]
            every += [a for a in (arguments.vararg, arguments.kwarg) if a]
            roots += [a.annotation for a in every if a.annotation]
            roots += [node.returns] if node.returns else []
        elif isinstance(node, ast.AnnAssign):
            roots.append(node.annotation)
    return {id(inner) for root in roots for inner in ast.walk(root)}


def _locals(function: ast.AST) -> set[str]:
    """Every name a function (or lambda) binds anywhere inside it: a local, not the module's."""
    bound: set[str] = set()
    for node in ast.walk(function):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            bound.add(node.id)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node is not function:
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    for node in ast.walk(function):
        if isinstance(node, ast.Global):
            bound.difference_update(node.names)
    return bound


def defined_names(statement: ast.stmt) -> list[str]:
    """The module-level names one top-level statement defines."""
    if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [statement.name]
    if isinstance(statement, ast.Assign):
        return [t.id for target in statement.targets for t in ast.walk(target) if isinstance(t, ast.Name)]
    if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
        return [statement.target.id]
    return []


def references(statement: ast.stmt, names: set[str]) -> set[str]:
    """The module-level names a top-level statement uses at run time (annotations aside)."""
    skip = _annotations(statement)
    used: set[str] = set()

    def visit(node: ast.AST, bound: frozenset[str]) -> None:
        if id(node) in skip:
            return
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            if node.id in names and node.id not in bound:
                used.add(node.id)
            return
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for outer in [*getattr(node, "decorator_list", []), *node.args.defaults, *node.args.kw_defaults]:
                if outer is not None:
                    visit(outer, bound)
            inner = bound | _locals(node)
            for child in node.body if isinstance(node.body, list) else [node.body]:
                visit(child, inner)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, bound)

    visit(statement, frozenset())
    return used


def _layout() -> tuple[ast.Module, list[str], list[Banner]]:
    source = MODULE.read_text(encoding="utf-8")
    lines = source.splitlines()
    return ast.parse(source), lines, banners(lines)


def _first_line(statement: ast.stmt) -> int:
    decorators = getattr(statement, "decorator_list", [])
    return min([statement.lineno, *(d.lineno for d in decorators)])


def upward_references() -> list[str]:
    """Each run-time use of a name defined in a later section than its user's, as one line."""
    tree, _, found = _layout()
    sections = [b for b in found if not b.letter]
    home: dict[str, int] = {}
    for statement in tree.body:
        section = section_of(_first_line(statement), sections)
        for name in defined_names(statement):
            home.setdefault(name, section.number if section else 0)
    wrong = []
    for statement in tree.body:
        section = section_of(_first_line(statement), sections)
        user = section.number if section else 0
        owner = ", ".join(defined_names(statement)) or f"the statement on line {statement.lineno}"
        for name in sorted(references(statement, set(home))):
            if home[name] > user:
                wrong.append(f"{owner} (section {user}) uses {name} (section {home[name]})")
    return wrong


def test_every_section_uses_only_itself_and_those_above() -> None:
    assert upward_references() == []


def test_the_sections_are_numbered_in_order_and_the_map_names_each_sub_section() -> None:
    tree, _, found = _layout()
    numbers = [b.number for b in found if not b.letter]
    assert numbers == list(range(1, len(numbers) + 1))
    docstring = ast.get_docstring(tree) or ""
    for banner in (b for b in found if b.letter):
        # A sub-section sits in its own section, in letter order, and the map lists it by its label.
        section = section_of(banner.line, [b for b in found if not b.letter])
        assert section is not None and section.number == banner.number, banner
        assert re.search(rf"^\s+{banner.number}{banner.letter}\. ", docstring, re.MULTILINE), banner


def test_the_pure_core_has_no_coroutine_no_logging_and_writes_no_file() -> None:
    tree, _, found = _layout()
    sections = [b for b in found if not b.letter]
    broken = []
    for statement in tree.body:
        section = section_of(_first_line(statement), sections)
        if section is None or section.number != PURE_CORE:
            continue
        for node in ast.walk(statement):
            where = f"line {getattr(node, 'lineno', statement.lineno)}"
            if isinstance(node, (ast.AsyncFunctionDef, ast.Await, ast.AsyncFor, ast.AsyncWith)):
                broken.append(f"{where}: async")
            if isinstance(node, ast.Name) and node.id in {"log", "_log", "logging"}:
                broken.append(f"{where}: logging ({node.id})")
            if not isinstance(node, ast.Call):
                continue
            name = _dotted(node.func)
            if name.rpartition(".")[2] in _LOGGING and name.partition(".")[0] in {"log", "_log", "logging", "self"}:
                broken.append(f"{where}: a logging call ({name})")
            if name in _WRITERS:
                broken.append(f"{where}: writes ({name})")
            if name == "open" or name.endswith(".open"):
                modes = [a for a in [*node.args[1:2], *(k.value for k in node.keywords if k.arg == "mode")]]
                flags = {n.attr for a in node.args[1:2] for n in ast.walk(a) if isinstance(n, ast.Attribute)}
                written = any(isinstance(m, ast.Constant) and set(str(m.value)) & set("wax+") for m in modes)
                if written or flags & {"O_WRONLY", "O_RDWR", "O_CREAT"}:
                    broken.append(f"{where}: opens for writing ({name})")
    assert broken == []


def test_every_exception_class_is_in_the_errors_section() -> None:
    # gopherplug's exceptions are GopherplugError's subclasses (the section's rule: one base class).
    tree, _, found = _layout()
    sections = [b for b in found if not b.letter]
    exceptions = {"GopherplugError"}
    misplaced = []
    for statement in tree.body:  # in order: a class's bases are defined above it
        if not isinstance(statement, ast.ClassDef):
            continue
        if {_dotted(base).rpartition(".")[2] for base in statement.bases} & exceptions or statement.name in exceptions:
            exceptions.add(statement.name)
            section = section_of(_first_line(statement), sections)
            if section is None or section.number != ERRORS:
                misplaced.append(statement.name)
    assert len(exceptions) > 1 and misplaced == []
