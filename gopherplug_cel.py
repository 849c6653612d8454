"""gopherplug_cel: a CEL device selector evaluated as the Kubernetes scheduler evaluates one.

A DeviceClass or a ResourceClaim's request selects devices with CEL expressions over ``device``
(its driver, attributes and capacity). This module evaluates one with cel-python, with the
Kubernetes CEL library's quantity and semver functions and cel-go's words for its errors:
``gopherplug demo --dra --select EXPR`` shows which of your devices it selects, and the scheduler
stand-in (gopherplug_standins.SchedulerSimulator) allocates with it.

  DeviceSelector   one selector, compiled once: matches(device) is true, false or CELError
  cel_device       the variable ``device`` for one device of a ResourceSlice
  CELError         a selector that fails, in cel-go's words (``compile`` when the API server
                   refuses it already)

It needs cel-python, the ``cel`` extra (pip install '.[cel]' in a checkout), imported where a selector
is compiled, and imports nothing of gopherplug's at module level, so that gopherplug imports it
where ``--select`` is given. The images carry neither.
"""

from __future__ import annotations

import decimal
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

__all__ = ["CELError", "DeviceSelector", "cel_device"]


#: A resource.Quantity as the API server parses one (k8s.io/apimachinery pkg/api/resource
#: quantity.go): a signed decimal number, then a binary (Ki ... Ei), decimal (n u m k M G T P E) or
#: exponent (e3, E-2) suffix, or none.
_QUANTITY = re.compile(r"([+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+))(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?[0-9]+)?")
_QUANTITY_SUFFIXES = {
    **{s: Decimal(1024) ** (i + 1) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
    **{s: Decimal(10) ** e for s, e in (("n", -9), ("u", -6), ("m", -3), ("k", 3), ("M", 6), ("G", 9))},
    **{s: Decimal(10) ** e for s, e in (("T", 12), ("P", 15), ("E", 18))},
}


def _quantity(value: Any) -> Decimal | None:
    """A quantity's value, None when the API server would not parse it (a number is taken as the
    JSON decoder takes it, a string by quantity.go's grammar)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return Decimal(str(value))
    match = _QUANTITY.fullmatch(str(value))
    if match is None:
        return None
    number, suffix = Decimal(match[1]), match[2] or ""
    if len(suffix) > 1 and suffix[0] in "eE":  # "E" alone is exa
        wide = decimal.Context(Emax=decimal.MAX_EMAX, Emin=decimal.MIN_EMIN)  # 1e9999999 is a quantity
        return number.scaleb(int(suffix[1:]), wide) if len(suffix) < 12 else None
    return number * _QUANTITY_SUFFIXES.get(suffix, Decimal(1))


# CEL as the scheduler evaluates a device selector: the variable `device` as
# k8s.io/dynamic-resource-allocation cel/compile.go builds it (DeviceMatches), the Kubernetes CEL
# library's quantity and semver functions (k8s.io/apiserver pkg/cel/library quantity.go and
# semver.go, in the base environment of 1.36), and the errors with cel-go's words. cel-python has no
# type checker: what cel-go refuses when it compiles (an undeclared name, a result that is not a
# bool) is found here as the expression runs, and the wording of a type error is cel-go's "no such
# overload" without its signature. ==, != and `in` are cel-go's heterogeneous equality (_equal), where
# cel-python's differ. Neither cel.bind nor the list-type attributes (DRAListTypeAttributes,
# "includes") are modelled.


class CELError(Exception):
    """A CEL selector that fails, in cel-go's words: ``compile`` when the API server would refuse it
    already (a ResourceClaim or DeviceClass with it is never stored), else an evaluation error, which
    fails the claim on the node where the scheduler meets it."""

    def __init__(self, message: str, compile: bool = False) -> None:
        super().__init__(message)
        self.message, self.compile = message, compile


@dataclass(frozen=True)
class _CelQuantity:
    """A resource.Quantity as CEL holds one: compared by value, never equal to a string or number."""

    value: Decimal


#: Its numbers and the order of the identifiers of a pre-release (semver.org 2.0.0, item 11).
_SemverKey = tuple[int, int, int, tuple[tuple[int, int, str], ...]]


@dataclass(frozen=True)
class _CelSemver:
    """A semantic version as CEL holds one (apiservercel.Semver, blang/semver's Version): a version
    attribute's value, or what semver() returns. Compared by precedence; build metadata is kept but
    never compared."""

    major: int
    minor: int
    patch: int
    pre: tuple[str, ...] = ()
    build: tuple[str, ...] = ()

    def key(self) -> _SemverKey:
        # A version without a pre-release is greater than one with one: (1,) beats (0, ...).
        pre = tuple((1, int(p), "") if p.isdigit() else (2, 0, p) for p in self.pre)
        return (self.major, self.minor, self.patch, ((1, 0, ""),) if not pre else ((0, 0, ""), *pre))


def _parse_semver(text: str, normalize: bool = False) -> _CelSemver:
    """``text`` as blang/semver's Parse reads it, strictly MAJOR.MINOR.PATCH, with its errors (so
    "4.17" is refused: "No Major.Minor.Patch elements found"); with ``normalize``, first as the
    library's normalizeAndParse: a leading "v" removed, leading zeros removed, ".0" added to a short
    version. ValueError with blang/semver's message."""
    if normalize:
        parts = text.removeprefix("v").split(".", 2)
        parts = [p.lstrip("0") if len(p) > 1 else p for p in parts]
        parts = [p if p[:1].isdigit() else "0" + p for p in parts]
        if len(parts) < 3 and any(c in parts[-1] for c in "+-"):
            raise ValueError("short version cannot contain PreRelease/Build meta data")
        text = ".".join(parts + ["0"] * (3 - len(parts)))
    if not text:
        raise ValueError("Version string empty")
    parts = text.split(".", 2)
    if len(parts) != 3:
        raise ValueError("No Major.Minor.Patch elements found")
    build: list[str] = []
    pre: list[str] = []
    patch, plus, meta = parts[2].partition("+")
    if plus:
        build = meta.split(".")
    patch, minus, release = patch.partition("-")
    if minus:
        pre = release.split(".")
    numbers = []
    for name, number in zip(("major", "minor", "patch"), (parts[0], parts[1], patch), strict=True):
        if number.strip("0123456789"):
            raise ValueError(f"Invalid character(s) found in {name} number {_go_quote(number)}")
        if len(number) > 1 and number[0] == "0":
            raise ValueError(f"{name.capitalize()} number must not contain leading zeroes {_go_quote(number)}")
        if not number:
            raise ValueError('strconv.ParseUint: parsing "": invalid syntax')
        numbers.append(int(number))
    for identifier in pre:
        if not identifier:
            raise ValueError("Prerelease is empty")
        if identifier.strip(_ALPHANUMERIC):
            raise ValueError(f"Invalid character(s) found in prerelease {_go_quote(identifier)}")
        if identifier.isdigit() and len(identifier) > 1 and identifier[0] == "0":
            raise ValueError(f"Numeric PreRelease version must not contain leading zeroes {_go_quote(identifier)}")
    for identifier in build:
        if not identifier:
            raise ValueError("Build meta data is empty")
        if identifier.strip(_ALPHANUMERIC):
            raise ValueError(f"Invalid character(s) found in build meta data {_go_quote(identifier)}")
    return _CelSemver(numbers[0], numbers[1], numbers[2], tuple(pre), tuple(build))


_ALPHANUMERIC = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-"


def _go_quote(text: str) -> str:
    return json.dumps(text)  # Go's %q, for the ASCII a version holds


#: resource.ParseQuantity's error for a string it cannot read (ErrFormatWrong in
#: k8s.io/apimachinery pkg/api/resource/quantity.go).
_QUANTITY_FORMAT_WRONG = "quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'"


def _cel_library() -> dict[str, Callable[..., Any]]:
    """The Kubernetes CEL library a selector may call, for cel-python: quantity.go's quantity(),
    isQuantity(), and on a quantity sign, isInteger, asInteger, asApproximateFloat, add, sub
    (a quantity or an int), compareTo, isGreaterThan, isLessThan; semver.go's semver() and
    isSemver() (each with an optional normalize flag), and on a version major, minor, patch,
    compareTo, isGreaterThan, isLessThan. A method shared by both types takes the receiver's; two
    receivers of different types, or any other argument, are cel-go's "no such overload". And ==,
    != and `in` as cel-go has them (_equal)."""
    import celpy  # the cel extra's: where a selector is compiled, never on a node
    from celpy.evaluation import CELEvalError

    types = celpy.celtypes
    no_such_overload = CELEvalError("no such overload")

    def quantity(text: Any, *more: Any) -> Any:
        if more or not isinstance(text, types.StringType):
            return no_such_overload
        value = _quantity(str(text)) if not isinstance(text, bool) else None
        return _CelQuantity(value) if value is not None else CELEvalError(_QUANTITY_FORMAT_WRONG)

    def semver(text: Any, normalize: Any = False) -> Any:
        if not isinstance(text, types.StringType) or not isinstance(normalize, bool | types.BoolType):
            return no_such_overload
        try:
            return _parse_semver(str(text), bool(normalize))
        except ValueError as error:
            return CELEvalError(str(error))

    def is_semver(text: Any, normalize: Any = False) -> Any:
        result = semver(text, normalize)
        return result if result is no_such_overload else types.BoolType(isinstance(result, _CelSemver))

    def compare(a: Any, b: Any) -> int | None:
        if isinstance(a, _CelQuantity) and isinstance(b, _CelQuantity):
            x, y = a.value, b.value
        elif isinstance(a, _CelSemver) and isinstance(b, _CelSemver):
            x, y = a.key(), b.key()  # type: ignore[assignment]
        else:
            return None
        return (x > y) - (x < y)  # type: ignore[operator]

    def comparing(verdict: Callable[[int], Any]) -> Callable[[Any, Any], Any]:
        def method(a: Any, b: Any) -> Any:
            order = compare(a, b)
            return no_such_overload if order is None else verdict(order)

        return method

    def on_quantity(function: Callable[..., Any]) -> Callable[..., Any]:
        def method(a: Any, *args: Any) -> Any:
            return function(a.value, *args) if isinstance(a, _CelQuantity) else no_such_overload

        return method

    def on_semver(field: str) -> Callable[[Any], Any]:
        def method(a: Any) -> Any:
            return types.IntType(getattr(a, field)) if isinstance(a, _CelSemver) else no_such_overload

        return method

    def arithmetic(sign: int) -> Callable[[Any, Any], Any]:
        def method(a: Decimal, b: Any) -> Any:
            if isinstance(b, _CelQuantity):
                return _CelQuantity(a + sign * b.value)
            if isinstance(b, types.IntType):
                return _CelQuantity(a + sign * int(b))
            return no_such_overload

        return method

    def as_integer(a: Decimal) -> Any:
        # Quantity.AsInt64: a whole number within int64, else the library's error.
        if a != a.to_integral_value() or not -(2**63) <= a < 2**63:
            return CELEvalError("cannot convert value to integer")
        return types.IntType(int(a))

    return {
        "quantity": quantity,
        "isQuantity": lambda text: types.BoolType(isinstance(quantity(text), _CelQuantity)),
        "sign": on_quantity(lambda a: types.IntType((a > 0) - (a < 0))),
        "isInteger": on_quantity(lambda a: types.BoolType(not isinstance(as_integer(a), CELEvalError))),
        "asInteger": on_quantity(as_integer),
        "asApproximateFloat": on_quantity(lambda a: types.DoubleType(float(a))),
        "add": on_quantity(arithmetic(1)),
        "sub": on_quantity(arithmetic(-1)),
        "semver": semver,
        "isSemver": is_semver,
        "major": on_semver("major"),
        "minor": on_semver("minor"),
        "patch": on_semver("patch"),
        "compareTo": comparing(types.IntType),
        "isGreaterThan": comparing(lambda order: types.BoolType(order > 0)),
        "isLessThan": comparing(lambda order: types.BoolType(order < 0)),
        "_==_": _equal,
        "_!=_": lambda a, b: (lambda same: same if isinstance(same, CELEvalError) else types.BoolType(not same))(
            _equal(a, b)
        ),
        "_in_": lambda item, container: _contains(container, item),
    }


def _equal(a: Any, b: Any) -> Any:
    """``a == b`` as cel-go evaluates it (Equal in cel-go common/types/types.go, then the left
    value's Equal): heterogeneous equality (cel-spec's proposal 210), where values of different
    types are unequal, not an error, so ``"1" == 1`` and ``true == 1`` are false (cel-python says
    "no such overload"), while an int, a uint and a double compare as numbers. A list or a map is
    equal element by element. A quantity or a version on the left compared with another type is
    "no such overload" (Equal of Quantity and Semver in k8s.io/apiserver pkg/cel); versions compare
    by precedence, build metadata ignored (blang/semver's EQ)."""
    import celpy
    from celpy.evaluation import CELEvalError

    types = celpy.celtypes
    for value in (a, b):
        if isinstance(value, CELEvalError):
            return value
    null = [value is None or isinstance(value, types.NullType) for value in (a, b)]
    if any(null):
        return types.BoolType(null[0] == null[1])
    if isinstance(a, _CelQuantity | _CelSemver):
        if isinstance(a, _CelQuantity) and isinstance(b, _CelQuantity):
            return types.BoolType(a.value == b.value)
        if isinstance(a, _CelSemver) and isinstance(b, _CelSemver):
            return types.BoolType(a.key() == b.key())
        return CELEvalError("no such overload")
    numbers = (types.IntType, types.UintType, types.DoubleType)
    if isinstance(a, numbers) and isinstance(b, numbers):  # by value, exactly (a Decimal holds a double)
        return types.BoolType(Decimal(a) == Decimal(b))
    if isinstance(a, types.ListType) and isinstance(b, types.ListType):
        return types.BoolType(len(a) == len(b) and all(_true(_equal(x, y)) for x, y in zip(a, b, strict=True)))
    if isinstance(a, types.MapType) and isinstance(b, types.MapType):
        keys = {k: next((j for j in b if _true(_equal(k, j))), None) for k in a}
        return types.BoolType(
            len(a) == len(b) and all(j is not None and _true(_equal(a[k], b[j])) for k, j in keys.items())
        )
    return types.BoolType(type(a) is type(b) and a == b)


def _true(result: Any) -> bool:
    """Whether a CEL result is true (not false, and not an error)."""
    import celpy

    return isinstance(result, celpy.celtypes.BoolType) and bool(result)


def _contains(container: Any, item: Any) -> Any:
    """``item in container`` as cel-go has it: a list holds an element equal to it (heterogeneously,
    as _equal), a map a key."""
    import celpy
    from celpy.evaluation import CELEvalError

    types = celpy.celtypes
    if isinstance(container, CELEvalError):
        return container
    if not isinstance(container, types.ListType | types.MapType):
        return CELEvalError("no such overload")
    return types.BoolType(any(_true(_equal(item, element)) for element in container))


def cel_device(driver: str, device: Mapping[str, Any]) -> Any:
    """The CEL variable ``device`` for one device of a ResourceSlice of ``driver``, as DeviceMatches
    builds it (k8s.io/dynamic-resource-allocation cel/compile.go): ``driver``;
    ``allowMultipleAllocations`` (false when unset); ``attributes`` and ``capacity`` by domain (the
    driver's for a name without one), then name: an attribute's value of its own type, a version a
    semantic version, a capacity a quantity. Looking up a domain the device has not gives an empty
    map, so a missing attribute is "no such key: <name>" whatever its domain."""
    import celpy  # the cel extra's: where a selector is compiled, never on a node

    types = celpy.celtypes

    class WithDefault(types.MapType):  # newStringInterfaceMapWithDefault
        def __getitem__(self, key: Any) -> Any:
            return super().__getitem__(key) if key in self else types.MapType({})

    def by_domain(values: dict[str, dict[str, Any]]) -> Any:
        return WithDefault({types.StringType(domain): types.MapType(names) for domain, names in values.items()})

    convert: dict[str, Callable[[Any], Any]] = {
        "bool": types.BoolType,
        "int": types.IntType,
        "string": types.StringType,
        "version": lambda text: _parse_semver(text),  # the API server let only valid versions in
    }
    attributes: dict[str, dict[str, Any]] = {}
    for qualified, value in (device.get("attributes") or {}).items():
        domain, _, name = qualified.rpartition("/")
        ((kind, raw),) = value.items()
        attributes.setdefault(domain or driver, {})[types.StringType(name)] = convert[kind](raw)
    capacity: dict[str, dict[str, Any]] = {}
    for qualified, held in (device.get("capacity") or {}).items():
        domain, _, name = qualified.rpartition("/")
        capacity.setdefault(domain or driver, {})[types.StringType(name)] = _CelQuantity(
            _quantity(held["value"]) or Decimal(0)
        )
    return types.MapType(
        {
            types.StringType("driver"): types.StringType(driver),
            types.StringType("allowMultipleAllocations"): types.BoolType(
                device.get("allowMultipleAllocations") is True
            ),
            types.StringType("attributes"): by_domain(attributes),
            types.StringType("capacity"): by_domain(capacity),
        }
    )


class DeviceSelector:
    """A CEL device selector (a DeviceClass's or a request's ``selectors[].cel.expression``),
    compiled once, evaluated on devices as the scheduler's allocator does (selectorsMatch in
    k8s.io/dynamic-resource-allocation structured). CELError when it does not compile; matches()
    says whether a device is selected, or raises CELError with the evaluation's error."""

    def __init__(self, expression: str) -> None:
        import celpy  # the cel extra's: where a selector is compiled, never on a node

        self.expression = expression
        environment = celpy.Environment()
        try:
            tree = environment.compile(expression)
        except celpy.celparser.CELParseError as error:  # cel-go says what it expected; this says where
            where = f"{error.line}:{error.column}" if error.line is not None else "1:1"
            raise CELError(f"compilation failed: ERROR: <input>:{where}: Syntax error", compile=True) from None
        self._program = environment.program(tree, functions=_cel_library())
        try:  # what cel-go's checker refuses, found on a device with nothing (where it is reached)
            self.matches(cel_device("", {}))
        except CELError as error:
            if error.compile:
                raise

    def matches(self, device: Any) -> bool:
        """Whether the selector selects ``device``, a cel_device(): true or false, or CELError."""
        import celpy
        from celpy.evaluation import CELEvalError

        try:
            result: Any = self._program.evaluate({"device": device})
        except CELEvalError as error:  # cel-python raises what it does not return
            result = error
        if isinstance(result, CELEvalError):
            raise _cel_go_error(result)
        if not isinstance(result, celpy.celtypes.BoolType):  # ConvertToNative(bool) refuses the rest
            kind = _CEL_TYPE_NAMES.get(type(result), type(result).__name__.removesuffix("Type").lower())
            message = f"CEL result of type {kind} could not be converted to bool"
            raise CELError(f"{message}: unsupported native conversion from {kind} to 'bool'")
        return bool(result)


#: cel-go's names of the library's types, where a message names a type
_CEL_TYPE_NAMES = {_CelQuantity: "kubernetes.Quantity", _CelSemver: "kubernetes.Semver"}


def _cel_go_error(error: Exception) -> CELError:
    """cel-python's evaluation error in cel-go's words, where they differ."""
    text = str(error.args[0]) if error.args else str(error)
    if (found := re.match(r"no such member in mapping: '(.*)'$", text)) is not None:
        return CELError(f"no such key: {found[1]}")
    if text == "no such key" and len(error.args) > 2 and error.args[2]:
        return CELError(f"no such key: {error.args[2][0]}")
    if (found := re.match(r"undeclared reference to '([^']*)'", text)) is not None:
        return CELError(f"compilation failed: ERROR: undeclared reference to '{found[1]}' (in container '')", True)
    if text.startswith("found no matching overload") or text.startswith("no such overload"):
        return CELError("no such overload")
    return CELError(text)
