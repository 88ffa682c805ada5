"""The one codec of every tandem channel: typed messages as msgpack, never pickle.

A channel declares its messages as dataclasses and registers each under an explicit kind
(`Codec.register`). A message is sent as ``[kind, field, ...]`` and any dataclass inside it as
``[field, ...]``, fields in the order the class declares them; an enum travels as its value, a
tuple as an array, a dict as a map. Decoding follows the class's type hints: the kind must be
registered, every dataclass must arrive with exactly its fields, each of its declared type (an
int is also a float; a bare ``list`` or ``tuple`` is plain data of any shape), down through
nested dataclasses, tuples, dicts and optionals; enum values and ``__post_init__`` checks apply;
anything else raises ValueError. The items of a list of plain values (``list[int]``: token ids,
log-probs) are not checked one by one: that would cost a pass over every token of every step,
and whatever msgpack made of them is inert data (a wrong one fails where it is used).

Frames are decoded every model step, so the work per dataclass is laid out once per class from
its type hints, and a list of dataclasses (a step's sequences) is checked and built in bulk,
column by column: each field's types in all rows at once, the objects by one ``map``.
"""

from __future__ import annotations

import dataclasses
import enum
import threading
import types
import typing
from collections.abc import Callable
from itertools import repeat
from operator import attrgetter

import msgpack

Convert = Callable[[typing.Any], typing.Any]

_LEAVES = {
    int: {int},
    float: {float, int},
    bool: {bool},
    str: {str},
    bytes: {bytes},
    type(None): {type(None)},
    list: {list},
}
_LIST = frozenset({list})
_classes: dict[type, _Class] = {}
_compiling = threading.RLock()  # the exchange server decodes on several threads


class Codec:
    """One channel's messages, each a dataclass registered under a kind of its own."""

    def __init__(self, channel: str):
        self.channel = channel
        self._classes: dict[str, type] = {}
        self._kinds: dict[type, str] = {}

    def register(self, kind: str):
        """Class decorator: send instances of the class as messages of ``kind``."""

        def register(cls: type) -> type:
            if not dataclasses.is_dataclass(cls):
                raise TypeError(f"{cls.__name__} is not a dataclass")
            if kind in self._classes or cls in self._kinds:
                raise ValueError(f"{self.channel}: {kind!r} or {cls.__name__} registered twice")
            self._classes[kind] = cls
            self._kinds[cls] = kind
            return cls

        return register

    def encode(self, msg) -> bytes:
        kind = self._kinds.get(type(msg))
        if kind is None:
            raise TypeError(f"not a {self.channel} message: {type(msg).__name__}")
        return msgpack.packb([kind, *_class(type(msg)).encode(msg)], default=_default)

    def decode(self, data: bytes):
        """The message in ``data``; ValueError for anything else (the peer may be anyone)."""
        kind = None
        try:
            wire = msgpack.unpackb(data)
            if type(wire) is not list or not wire or type(wire[0]) is not str:
                raise ValueError("not [kind, field, ...]")
            kind = wire[0]
            if kind not in self._classes:
                raise ValueError(f"unknown kind {kind!r}")
            del wire[0]
            return _class(self._classes[kind]).decode(wire)
        except (ValueError, TypeError, KeyError) as exc:  # msgpack's errors are ValueErrors
            what = f"{kind} message" if kind in self._classes else "frame"
            why = str(exc) or type(exc).__name__
            raise ValueError(f"malformed {self.channel} {what}: {why}") from None


def _default(value):
    """msgpack's hook for what it cannot pack by itself: a dataclass, an enum."""
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _class(type(value)).encode(value)
    raise TypeError(f"cannot encode a {type(value).__name__}")


@dataclasses.dataclass(frozen=True, slots=True)
class _Decoding:
    """How a value declared as some type is decoded: the Python types msgpack may hand over for
    it, and a function that converts and checks it further (None: the value is already what it
    should be; ``optional``: that function applies only to a value that is not None)."""

    allowed: frozenset
    convert: Convert | None = None
    optional: bool = False
    checks_itself: bool = False  # ``convert`` refuses a value of any other type
    many: Convert | None = None  # a dataclass: decodes a list of them at once

    def checked(self) -> Convert:
        """The whole decoding, its type check included."""
        allowed, convert, optional = self.allowed, self.convert, self.optional

        def checked(value):
            if type(value) not in allowed:
                raise ValueError(f"unexpected {type(value).__name__}")
            if convert is None or (optional and value is None):
                return value
            return convert(value)

        return checked


class _Class:
    """A dataclass's encoding and decoding, laid out once from its fields and type hints."""

    def __init__(self, cls: type):
        fields = dataclasses.fields(cls)
        if any(not f.init for f in fields):
            raise TypeError(f"{cls.__name__}: every field must be an __init__ argument")
        self.cls = cls
        self.names = [f.name for f in fields]
        hints = typing.get_type_hints(cls)
        self.specs = [_decoding(hints[n], f"{cls.__name__}.{n}") for n in self.names]
        self._converts = [(i, s) for i, s in enumerate(self.specs) if s.convert is not None]
        self._allowed = [s.allowed for s in self.specs]
        self._length = frozenset({len(self.names)})
        get = attrgetter(*self.names) if self.names else (lambda _: ())
        self._get = get if len(self.names) != 1 else (lambda value: (get(value),))
        items = [_dataclass_items(hints[name]) for name in self.names]
        self._bulk = [(i, _class(item).get_many) for i, item in enumerate(items) if item]

    def encode(self, value) -> tuple | list:
        """Its fields in order; lists of dataclasses as lists of their fields (the rest of what
        msgpack cannot pack, `_default` converts as msgpack meets it)."""
        if not self._bulk:
            return self._get(value)
        fields = list(self._get(value))
        for i, get_many in self._bulk:
            fields[i] = get_many(fields[i])
        return fields

    def get_many(self, values) -> list:
        return list(map(self._get, values)) if not self._bulk else list(map(self.encode, values))

    def decode(self, wire):
        """``[field, ...]`` as an instance."""
        if type(wire) is not list or len(wire) != len(self.names):
            raise self._wrong([wire])
        if not all(map(frozenset.__contains__, self._allowed, map(type, wire))):
            raise self._wrong([wire])
        for i, spec in self._converts:
            value = wire[i]
            if not (spec.optional and value is None):
                wire[i] = spec.convert(value)
        return self.cls(*wire)

    def decode_many(self, rows) -> list:
        """``rows`` (each ``[field, ...]``) as instances, column by column: each field's types
        in all rows checked at once, then converted (a column of dataclasses in bulk too),
        then the instances built."""
        if type(rows) is not list:
            raise ValueError(f"expected an array of {self.cls.__name__}, got {type(rows).__name__}")
        if not (_LIST.issuperset(map(type, rows)) and self._length.issuperset(map(len, rows))):
            raise self._wrong(rows)
        if not rows or not self.names:
            return [self.cls() for _ in rows]
        columns = list(zip(*rows, strict=True))
        if not all(map(frozenset.issuperset, self._allowed, map(map, repeat(type), columns))):
            raise self._wrong(rows)
        for i, spec in self._converts:
            columns[i] = _convert_column(spec, columns[i])
        return list(map(self.cls, *columns))

    def _wrong(self, rows: list) -> ValueError:
        """Why ``rows`` are not all instances (the slow path)."""
        name = self.cls.__name__
        for row in rows:
            if type(row) is not list:
                return ValueError(f"{name}: expected an array, got {type(row).__name__}")
            if len(row) != len(self.names):
                return ValueError(f"{name} has {len(self.names)} fields, got {len(row)}")
            for field, allowed, value in zip(self.names, self._allowed, row, strict=True):
                if type(value) not in allowed:
                    return ValueError(f"{name}.{field}: unexpected {type(value).__name__}")
        return ValueError(f"{name}: unexpected field types")


def _convert_column(spec: _Decoding, column: tuple) -> tuple | list:
    if not spec.optional:
        return spec.many(list(column)) if spec.many else list(map(spec.convert, column))
    if column.count(None) == len(column):  # the usual case: e.g. a step's settled sequences
        return column
    if spec.many is None:
        return [None if v is None else spec.convert(v) for v in column]
    present = [i for i, v in enumerate(column) if v is not None]
    out = list(column)
    for i, value in zip(present, spec.many([column[i] for i in present]), strict=True):
        out[i] = value
    return out


def _class(cls: type) -> _Class:
    found = _classes.get(cls)
    if found is None:
        with _compiling:
            found = _classes.get(cls) or _Class(cls)
            _classes[cls] = found
    return found


def _dataclass_items(hint) -> type | None:
    """The item class of a list (or tuple) of dataclasses, which is encoded in bulk."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is list or (origin is tuple and args[1:] == (Ellipsis,)):
        if dataclasses.is_dataclass(args[0]):
            return args[0]
    return None


def _decoding(hint, where: str) -> _Decoding:
    """How to decode a value declared as ``hint``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in _LEAVES:
        return _Decoding(frozenset(_LEAVES[hint]))
    if isinstance(hint, enum.EnumMeta):
        return _Decoding(frozenset(type(m.value) for m in hint), hint, checks_itself=True)
    if dataclasses.is_dataclass(hint):
        lazy = _Lazy(hint)
        return _Decoding(_LIST, lazy.decode, checks_itself=True, many=lazy.decode_many)
    if hint is tuple:  # plain data of any shape
        return _Decoding(_LIST, tuple)
    if origin is list or (origin is tuple and args[1:] == (Ellipsis,)):
        to = list if origin is list else tuple
        if dataclasses.is_dataclass(args[0]):
            many = _Lazy(args[0]).decode_many
            return _Decoding(_LIST, many if to is list else (lambda wire: tuple(many(wire))))
        item = _decoding(args[0], where)
        if item.convert is None:  # plain values (see the module's docstring)
            return _Decoding(_LIST, None if to is list else tuple)
        convert = item.convert if item.checks_itself else item.checked()
        return _Decoding(_LIST, lambda wire: to(map(convert, wire)))
    if origin is tuple:
        return _Decoding(_LIST, _fixed([_decoding(a, where).checked() for a in args]))
    if origin is dict:
        key, value = _decoding(args[0], where).checked(), _decoding(args[1], where).checked()
        return _Decoding(frozenset({dict}), lambda w: {key(k): value(v) for k, v in w.items()})
    if origin in (typing.Union, types.UnionType):
        return _union([_decoding(a, where) for a in args], where)
    raise TypeError(f"{where}: cannot decode {hint!r}")


class _Lazy:
    """A dataclass's decoding, laid out when first used (a class may name ones defined later)."""

    def __init__(self, cls: type):
        self.cls = cls

    def decode(self, wire):
        return _class(self.cls).decode(wire)

    def decode_many(self, rows) -> list:
        return _class(self.cls).decode_many(rows)


def _fixed(items: list[Convert]) -> Convert:
    def fixed(wire: list) -> tuple:
        if len(wire) != len(items):
            raise ValueError(f"expected {len(items)} items, got {len(wire)}")
        return tuple(item(v) for item, v in zip(items, wire, strict=True))

    return fixed


def _union(members: list[_Decoding], where: str) -> _Decoding:
    by_type: dict[type, _Decoding] = {}
    for member in members:
        for t in member.allowed:
            if t in by_type:
                raise TypeError(f"{where}: two members of the union arrive as {t.__name__}")
            by_type[t] = member
    allowed = frozenset(by_type)
    converting = [m for m in members if m.convert is not None]
    if not converting:
        return _Decoding(allowed)
    others = [m for m in members if m.convert is None]
    if len(converting) == 1 and [m.allowed for m in others] == [frozenset({type(None)})]:
        (member,) = converting  # X | None
        return _Decoding(allowed, member.convert, optional=True, many=member.many)
    steps = {t: m.convert for t, m in by_type.items() if m.convert is not None}

    def convert(value):
        step = steps.get(type(value))
        return value if step is None else step(value)

    return _Decoding(allowed, convert)
