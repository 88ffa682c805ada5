"""The one codec of every tandem channel: typed messages as msgpack, never pickle.

A channel declares its messages as dataclasses and registers each under an explicit kind
(`Codec.register`). A message is sent as ``[kind, field, ...]`` and any dataclass inside it as
``[field, ...]``, fields in the order the class declares them; an enum travels as its value, a
tuple as an array, a dict as a map. Decoding follows the class's type hints: the kind must be
registered, every dataclass must arrive with exactly its fields, each value of its declared type
(an int is also a float; a bare ``list`` or ``tuple`` is plain data of any shape), and enum
values and ``__post_init__`` checks apply; anything else raises ValueError.

Frames are decoded every model step, so each dataclass's encoder and decoder are written once,
from its fields and type hints, as one small Python function (as `dataclasses` writes
``__init__``): a frame then costs what hand-written unpacking would. Only type hints of our own
classes ever reach that source; a frame's content is only compared and copied.
"""

from __future__ import annotations

import dataclasses
import enum
import threading
import types
import typing
from collections.abc import Callable
from operator import attrgetter

import msgpack

Convert = Callable[[typing.Any], typing.Any]

_LEAVES = {int: {int}, float: {float, int}, bool: {bool}, str: {str}, bytes: {bytes},
           type(None): {type(None)}, list: {list}}  # fmt: skip
_decoders: dict[type, Convert] = {}
_encoders: dict[type, Convert] = {}
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
        return msgpack.packb([kind, *_encoder(type(msg))(msg)])

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
            return _decoder(self._classes[kind])(wire[1:])
        except (ValueError, TypeError, KeyError) as exc:  # msgpack's errors are ValueErrors
            what = f"{kind} message" if kind in self._classes else "frame"
            why = str(exc) or type(exc).__name__
            raise ValueError(f"malformed {self.channel} {what}: {why}") from None


@dataclasses.dataclass(frozen=True, slots=True)
class _Decoding:
    """How a value declared as some type is decoded: the Python types msgpack may hand over for
    it, the types of its items if it is a list of plain values, and a function that converts
    (and checks) it further (None: the value is already what it should be)."""

    allowed: frozenset
    convert: Convert | None = None
    items: frozenset | None = None

    def finish(self) -> Convert | None:
        """The rest of the work once the value's own type was checked (None: nothing)."""
        items, convert = self.items, self.convert
        if items is None:
            return convert

        def finish(value):
            if not items.issuperset(map(type, value)):
                raise ValueError(f"unexpected {_names(set(map(type, value)) - items)} in a list")
            return value if convert is None else convert(value)

        return finish

    def checked(self) -> Convert:
        allowed, finish = self.allowed, self.finish()

        def checked(value):
            if type(value) not in allowed:
                raise ValueError(f"unexpected {type(value).__name__}")
            return value if finish is None else finish(value)

        return checked


def _decoder(cls: type) -> Convert:
    decode = _decoders.get(cls)
    if decode is None:
        with _compiling:
            decode = _decoders.get(cls) or _write(cls, _decode_source)
            _decoders[cls] = decode
    return decode


def _encoder(cls: type) -> Convert:
    encode = _encoders.get(cls)
    if encode is None:
        with _compiling:
            encode = _encoders.get(cls) or _write(cls, _encode_source)
            _encoders[cls] = encode
    return encode


def _write(cls: type, source) -> Convert:
    fields = dataclasses.fields(cls)
    if any(not f.init for f in fields):
        raise TypeError(f"{cls.__name__}: every field must be an __init__ argument")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in fields]
    namespace = {"_cls": cls}
    text = source(cls, names, [hints[n] for n in names], namespace)
    exec(compile(text, f"<tandem.wire {cls.__name__}>", "exec"), namespace)
    return namespace["_convert"]


def _decode_source(cls: type, names: list[str], hints: list, namespace: dict) -> str:
    """``[field, ...]`` -> ``cls``: the array's length and each field's type in one test, then
    the conversions its hints call for, then ``cls(...)``."""
    specs = [_decoding(h, f"{cls.__name__}.{n}") for n, h in zip(names, hints, strict=True)]
    namespace["_wrong"] = lambda wire: _wrong(cls, names, specs, wire)
    local = [f"f{i}" for i in range(len(names))]
    tests, values = [], []
    for i, (f, spec) in enumerate(zip(local, specs, strict=True)):
        namespace[f"_A{i}"] = spec.allowed
        (only,) = spec.allowed if len(spec.allowed) == 1 else (None,)
        namespace[f"_T{i}"] = only
        tests.append(f"type({f}) is _T{i}" if only is not None else f"type({f}) in _A{i}")
        if spec.items is not None:
            namespace[f"_I{i}"] = spec.items
            tests.append(f"_I{i}.issuperset(map(type, {f}))")
        namespace[f"_C{i}"] = spec.convert
        values.append(f"_C{i}({f})" if spec.convert is not None else f)
    unpack = f"    {', '.join(local)}, = wire\n" if local else ""
    test = f"    if not ({' and '.join(tests)}):\n        raise _wrong(wire)\n" if tests else ""
    return (f"def _convert(wire):\n"
            f"    if type(wire) is not list or len(wire) != {len(names)}:\n"
            f"        raise _wrong(wire)\n{unpack}{test}"
            f"    return _cls({', '.join(values)})\n")  # fmt: skip


def _wrong(cls: type, names: list[str], specs: list[_Decoding], wire) -> ValueError:
    """Why ``wire`` is not a ``cls`` (the slow path of a decoder)."""
    if type(wire) is not list:
        return ValueError(f"{cls.__name__}: expected an array, got {type(wire).__name__}")
    if len(wire) != len(names):
        return ValueError(f"{cls.__name__} has {len(names)} fields, got {len(wire)}")
    for name, spec, value in zip(names, specs, wire, strict=True):
        try:
            spec.checked()(value)
        except ValueError as exc:
            return ValueError(f"{cls.__name__}.{name}: {exc}")
    return ValueError(f"{cls.__name__}: unexpected field types")


def _decoding(hint, where: str) -> _Decoding:
    """How to decode a value declared as ``hint``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in _LEAVES:
        return _Decoding(frozenset(_LEAVES[hint]))
    if isinstance(hint, enum.EnumMeta):
        return _Decoding(frozenset(type(m.value) for m in hint), hint)
    if dataclasses.is_dataclass(hint):
        return _Decoding(frozenset({list}), _decoder(hint))
    if hint is tuple:  # plain data of any shape
        return _Decoding(frozenset({list}), tuple)
    if origin is list or (origin is tuple and len(args) == 2 and args[1] is Ellipsis):
        item = _decoding(args[0], where)
        to = tuple if origin is tuple else None
        if item.convert is None and item.items is None:
            return _Decoding(frozenset({list}), to, item.allowed)
        convert = item.checked()
        if to is tuple:
            return _Decoding(frozenset({list}), lambda wire: tuple(map(convert, wire)))
        return _Decoding(frozenset({list}), lambda wire: list(map(convert, wire)))
    if origin is tuple:
        return _Decoding(frozenset({list}), _fixed([_decoding(a, where).checked() for a in args]))
    if origin is dict:
        key, value = _decoding(args[0], where).checked(), _decoding(args[1], where).checked()
        return _Decoding(frozenset({dict}), lambda w: {key(k): value(v) for k, v in w.items()})
    if origin in (typing.Union, types.UnionType):
        return _union([_decoding(a, where) for a in args], where)
    raise TypeError(f"{where}: cannot decode {hint!r}")


def _fixed(items: list[Convert]) -> Convert:
    def fixed(wire: list) -> tuple:
        if len(wire) != len(items):
            raise ValueError(f"expected {len(items)} items, got {len(wire)}")
        return tuple(item(v) for item, v in zip(items, wire, strict=True))

    return fixed


def _union(members: list[_Decoding], where: str) -> _Decoding:
    finish: dict[type, Convert | None] = {}
    for member in members:
        for t in member.allowed:
            if t in finish:
                raise TypeError(f"{where}: two members of the union arrive as {t.__name__}")
            finish[t] = member.finish()
    steps = {t: f for t, f in finish.items() if f is not None}
    if not steps:
        return _Decoding(frozenset(finish))

    def convert(value):
        step = steps.get(type(value))
        return value if step is None else step(value)

    return _Decoding(frozenset(finish), convert)


def _encode_source(cls: type, names: list[str], hints: list, namespace: dict) -> str:
    """``cls`` -> ``(field, ...)``: plain fields as they are, the others converted."""
    values = []
    for i, (name, hint) in enumerate(zip(names, hints, strict=True)):
        encode = _encoding(hint, f"{cls.__name__}.{name}")
        namespace[f"_E{i}"] = encode
        values.append(f"m.{name}" if encode is None else f"_E{i}(m.{name})")
    return f"def _convert(m):\n    return ({''.join(v + ', ' for v in values)})\n"


def _encoding(hint, where: str) -> Convert | None:
    """How to encode a value declared as ``hint`` (None: msgpack packs it as it is)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in _LEAVES or hint is tuple:
        return None
    if isinstance(hint, enum.EnumMeta):
        return attrgetter("value")
    if dataclasses.is_dataclass(hint):
        return _encoder(hint)
    if origin in (list, tuple) and (origin is list or args[1:] == (Ellipsis,)):
        item = _encoding(args[0], where)
        return None if item is None else (lambda value: [item(v) for v in value])
    if origin is tuple:
        items = [_encoding(a, where) or (lambda v: v) for a in args]
        return lambda value: [item(v) for item, v in zip(items, value, strict=True)]
    if origin is dict:
        key, value_ = _encoding(args[0], where), _encoding(args[1], where)
        if key is None and value_ is None:
            return None
        key, value_ = key or (lambda v: v), value_ or (lambda v: v)
        return lambda value: {key(k): value_(v) for k, v in value.items()}
    if origin in (typing.Union, types.UnionType):
        by_class = {}
        for member in args:
            encode = _encoding(member, where)
            if encode is not None and not (dataclasses.is_dataclass(member)
                                           or isinstance(member, enum.EnumMeta)):  # fmt: skip
                raise TypeError(f"{where}: cannot encode {member!r} inside a union")
            by_class[member] = encode
        steps = {t: e for t, e in by_class.items() if e is not None}
        if not steps:
            return None
        return lambda value: steps[type(value)](value) if type(value) in steps else value
    raise TypeError(f"{where}: cannot encode {hint!r}")


def _names(types_: set) -> str:
    return ", ".join(sorted(t.__name__ for t in types_))
