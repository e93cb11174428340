"""Pickle streams read as data: nothing is imported, called or built from them.

# Note [pickles as data]: a plain torch.distributed.checkpoint directory (one PyTorch's
# FSDP writes) stores its metadata, and each tensor's torch.save header, only as pickles.
# `parse` walks such a stream's opcodes itself and returns a tree of plain values: numbers,
# strings, bytes, None, booleans, lists, tuples, `Dict`s (key-value pairs, so that no key
# is ever hashed or compared by code from the file), and records of what the stream asked
# for: `Global` (a module and a name, two strings; never looked up), `Call` (a Global's
# REDUCE with its arguments), `Object` (NEWOBJ of a Global, with whatever BUILD gave it as
# `state`) and `Persistent` (a persistent id). Opcodes outside that set (the text protocol's
# INST and OBJ, extension registries, NEXT_BUFFER, ...) are refused. The caller matches the
# tree against the shapes it knows (dcp_format.py) and builds its own objects; an
# unknown Global is refused there by its two strings. Work is bounded by the stream's
# length: every opcode makes at most one node, and `Budget` caps what a conversion visits,
# so a stream that shares one container many times cannot blow up.
"""

from __future__ import annotations

import math
import struct
import time
from dataclasses import dataclass, field
from typing import Any


class PickleDataError(ValueError):
    """The stream is not a pickle of the data this reader takes."""


@dataclass(frozen=True)
class Global:
    module: str
    name: str


@dataclass(eq=False)
class Call:
    func: Any
    args: tuple


@dataclass(eq=False)
class Object:
    cls: Any
    args: tuple
    state: Any = None


@dataclass(eq=False)
class Persistent:
    pid: Any


@dataclass(eq=False)
class Dict:
    items: list[tuple[Any, Any]] = field(default_factory=list)


class Mark:
    """The MARK opcode's place on the stack."""


MARK = Mark()


def parse(data: bytes, deadline: float = math.inf) -> Any:
    """The value a pickle stream describes, as the tree of Note [pickles as data], parsed by
    `deadline` (time.monotonic(); PickleDataError after it)."""
    stack: list[Any] = []
    memo: dict[int, Any] = {}
    pos, end = 0, len(data)

    def take(n: int) -> bytes:
        nonlocal pos
        if n < 0 or pos + n > end:
            raise PickleDataError(f"the stream ends inside an opcode at byte {pos}")
        chunk = data[pos : pos + n]
        pos += n
        return chunk

    def unpack(fmt: str) -> Any:
        return struct.unpack(fmt, take(struct.calcsize(fmt)))[0]

    def pop() -> Any:
        if not stack or stack[-1] is MARK:
            raise PickleDataError(f"an opcode at byte {pos} takes a value the stack does not have")
        return stack.pop()

    def pop_mark() -> list[Any]:
        for i in range(len(stack) - 1, -1, -1):
            if stack[i] is MARK:
                items = stack[i + 1 :]
                del stack[i:]
                return items
        raise PickleDataError(f"an opcode at byte {pos} needs a MARK that is not there")

    def text(raw: bytes) -> str:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise PickleDataError(f"a string before byte {pos} is not UTF-8") from None

    def top(kind: type) -> Any:
        if not stack or not isinstance(stack[-1], kind):
            raise PickleDataError(f"an opcode at byte {pos} adds to something that is not a {kind.__name__}")
        return stack[-1]

    ops = 0
    while True:
        op = take(1)
        ops += 1
        if ops % 65536 == 0 and time.monotonic() > deadline:
            raise PickleDataError(f"parsing did not finish within the load's timeout (at byte {pos} of {end})")
        if op == b"\x80":  # PROTO
            if take(1)[0] > 5:
                raise PickleDataError("the stream's pickle protocol is newer than 5")
        elif op == b"\x95":  # FRAME: a length hint only
            take(8)
        elif op == b".":  # STOP
            value = pop()
            if stack:
                raise PickleDataError("the stream stops with values left on its stack")
            return value
        elif op == b"(":
            stack.append(MARK)
        elif op == b"0":  # POP
            pop()
        elif op == b"1":  # POP_MARK
            pop_mark()
        elif op == b"2":  # DUP
            stack.append(top(object))
        elif op == b"\x94":  # MEMOIZE
            memo[len(memo)] = top(object)
        elif op in (b"q", b"r"):  # BINPUT, LONG_BINPUT
            memo[unpack("<B" if op == b"q" else "<I")] = top(object)
        elif op in (b"h", b"j"):  # BINGET, LONG_BINGET
            key = unpack("<B" if op == b"h" else "<I")
            if key not in memo:
                raise PickleDataError(f"the stream reads memo entry {key}, which it never wrote")
            stack.append(memo[key])
        elif op == b"N":
            stack.append(None)
        elif op in (b"\x88", b"\x89"):  # NEWTRUE, NEWFALSE
            stack.append(op == b"\x88")
        elif op == b"J":
            stack.append(unpack("<i"))
        elif op == b"K":
            stack.append(unpack("<B"))
        elif op == b"M":
            stack.append(unpack("<H"))
        elif op in (b"\x8a", b"\x8b"):  # LONG1, LONG4
            n = unpack("<B" if op == b"\x8a" else "<i")
            stack.append(int.from_bytes(take(n), "little", signed=True))
        elif op == b"G":
            stack.append(unpack(">d"))
        elif op == b"\x8c":  # SHORT_BINUNICODE
            stack.append(text(take(unpack("<B"))))
        elif op == b"X":
            stack.append(text(take(unpack("<I"))))
        elif op == b"\x8d":  # BINUNICODE8
            stack.append(text(take(unpack("<Q"))))
        elif op == b"C":  # SHORT_BINBYTES
            stack.append(take(unpack("<B")))
        elif op == b"B":
            stack.append(take(unpack("<I")))
        elif op == b"\x8e":  # BINBYTES8
            stack.append(take(unpack("<Q")))
        elif op == b")":
            stack.append(())
        elif op in (b"\x85", b"\x86", b"\x87"):  # TUPLE1..3
            n = op[0] - 0x84
            if len(stack) < n or any(v is MARK for v in stack[-n:]):
                raise PickleDataError(f"TUPLE{n} at byte {pos} has too few values")
            items = tuple(stack[-n:])
            del stack[-n:]
            stack.append(items)
        elif op == b"t":
            stack.append(tuple(pop_mark()))
        elif op == b"]":
            stack.append([])
        elif op == b"l":
            stack.append(pop_mark())
        elif op == b"a":
            value = pop()
            top(list).append(value)
        elif op == b"e":
            items = pop_mark()
            top(list).extend(items)
        elif op == b"}":
            stack.append(Dict())
        elif op == b"d":
            items = pop_mark()
            stack.append(Dict(pairs(items)))
        elif op == b"s":
            value, key = pop(), pop()
            top(Dict).items.append((key, value))
        elif op == b"u":
            items = pop_mark()
            top(Dict).items.extend(pairs(items))
        elif op == b"\x8f":  # EMPTY_SET
            stack.append(Call(Global("builtins", "set"), ([],)))
        elif op == b"\x90":  # ADDITEMS
            items = pop_mark()
            target = top(Call)
            if target.func != Global("builtins", "set"):
                raise PickleDataError(f"ADDITEMS at byte {pos} adds to something that is not a set")
            target.args[0].extend(items)
        elif op == b"\x91":  # FROZENSET
            stack.append(Call(Global("builtins", "frozenset"), (pop_mark(),)))
        elif op == b"c":  # GLOBAL: "module\nname\n"
            raw_module = line(data, pos, end)
            pos += len(raw_module) + 1
            raw_name = line(data, pos, end)
            pos += len(raw_name) + 1
            stack.append(Global(text(raw_module), text(raw_name)))
        elif op == b"\x93":  # STACK_GLOBAL
            name, module = pop(), pop()
            if not (isinstance(module, str) and isinstance(name, str)):
                raise PickleDataError(f"STACK_GLOBAL at byte {pos} names a global with non-strings")
            stack.append(Global(module, name))
        elif op == b"R":  # REDUCE
            args, func = pop(), pop()
            if not isinstance(args, tuple):
                raise PickleDataError(f"REDUCE at byte {pos} has arguments that are not a tuple")
            stack.append(Call(func, args))
        elif op == b"\x81":  # NEWOBJ
            args, cls = pop(), pop()
            if not isinstance(args, tuple):
                raise PickleDataError(f"NEWOBJ at byte {pos} has arguments that are not a tuple")
            stack.append(Object(cls, args))
        elif op == b"b":  # BUILD: recorded on the Object, nothing is set on anything
            state = pop()
            target = top(Object)
            if target.state is not None:
                raise PickleDataError(f"BUILD at byte {pos} builds an object twice")
            target.state = state
        elif op == b"Q":  # BINPERSID
            stack.append(Persistent(pop()))
        else:
            raise PickleDataError(f"opcode {op!r} at byte {pos - 1} has no place in checkpoint data")


def line(data: bytes, pos: int, end: int) -> bytes:
    stop = data.find(b"\n", pos, min(end, pos + 256))
    if stop < 0:
        raise PickleDataError(f"GLOBAL at byte {pos} has no name line")
    return data[pos:stop]


def pairs(items: list[Any]) -> list[tuple[Any, Any]]:
    if len(items) % 2:
        raise PickleDataError("a dict in the stream has a key without a value")
    return list(zip(items[::2], items[1::2]))


class Budget:
    """How many nodes a conversion of a parsed tree may still visit (Note [pickles as data])."""

    def __init__(self, nodes: int) -> None:
        self.left = nodes

    def spend(self) -> None:
        self.left -= 1
        if self.left < 0:
            raise PickleDataError("the stream describes more values than its size allows")


PLAIN = (str, int, float, bool, bytes, type(None))


def plain(value: Any, budget: Budget, depth: int = 0) -> Any:
    """A tree of plain values (numbers, strings, bytes, None, booleans, lists, tuples and dicts
    with plain keys) as Python's own objects; anything else is refused."""
    budget.spend()
    if depth > 100:
        raise PickleDataError("the stream nests values more than 100 deep")
    if isinstance(value, PLAIN):
        return value
    if isinstance(value, list):
        return [plain(v, budget, depth + 1) for v in value]
    if isinstance(value, tuple):
        return tuple(plain(v, budget, depth + 1) for v in value)
    if isinstance(value, Dict):
        out = {}
        for key, item in value.items:
            key = plain(key, budget, depth + 1)
            if not isinstance(key, (str, int, float, bool, type(None))):
                raise PickleDataError(f"a dict in the stream has a key of type {type(key).__name__}")
            out[key] = plain(item, budget, depth + 1)
        return out
    raise PickleDataError(f"the stream holds {describe(value)}, which is not plain data")


def describe(value: Any) -> str:
    """What a node of the tree is, for messages (a Global by its two strings, never resolved)."""
    if isinstance(value, Global):
        return f"the global {value.module}.{value.name}"
    if isinstance(value, (Call, Object)):
        return f"a call of {describe(value.func if isinstance(value, Call) else value.cls)}"
    return f"a {type(value).__name__}"
