"""Type checks for the user-facing dataclasses (Config, SamplingParams, BeamSearchParams)."""
import dataclasses
import functools
import numbers
import types
import typing

import numpy as np

# What each annotated type accepts: numpy scalars count as numbers, a tuple as a list.
ACCEPTS = {int: (numbers.Integral,), float: (numbers.Real,), list: (list, tuple)}


def as_python(value):
    """numpy scalars as Python numbers and bools, also inside a list, tuple or dict (a numpy seed would break
    seed arithmetic and torch.manual_seed; the range checks test isinstance(x, int))."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, numbers.Integral) and type(value) is not int:
        return int(value)
    if isinstance(value, numbers.Real) and type(value) not in (int, float):   # np.float64 is a float subclass
        return float(value)
    if isinstance(value, (list, tuple)):
        return type(value)(as_python(v) for v in value)
    if isinstance(value, dict):
        return {as_python(k): as_python(v) for k, v in value.items()}
    return value


def check_known_keys(name: str, value: dict, known) -> None:
    """A config given as a dict: ValueError naming the keys that are not among known."""
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise ValueError(f"{name} has unknown key(s) {unknown}; known: {', '.join(known)}.")


def check_field_types(obj):
    """Raise ValueError naming the first init field whose value is not of its annotated type, so
    that max_num_seqs="8" is reported as such and not as a TypeError deep inside. Checked at the
    outer level: `X | None`; `list[X]` is a list or tuple; an int passes for a float; a bool only
    for a bool. numpy scalars are replaced by Python numbers first (as_python)."""
    for name, allowed, plain in _field_checks(type(obj)):
        value = getattr(obj, name)
        if type(value) in plain:   # a Python number, string or None where one is allowed: as it is
            continue
        value = as_python(value)
        object.__setattr__(obj, name, value)
        ok = any(isinstance(value, ACCEPTS.get(t, (t,))) for t in allowed)
        if isinstance(value, bool) and bool not in allowed:   # True is an int to Python, not here
            ok = False
        if not ok:
            names = " or ".join("None" if t is type(None) else t.__name__ for t in allowed)
            raise ValueError(f"{name} must be {names}, got {value!r:.200}.")


@functools.cache
def _field_checks(cls) -> tuple[tuple[str, tuple[type, ...], frozenset[type]], ...]:
    """cls's init fields as (name, the types allowed, the plain types whose values need neither a
    conversion nor a check), made once a class: a request's SamplingParams took ~150 us to make
    when every field went through as_python and isinstance, ~12 us with plain values passed by."""
    checks = []
    for f in dataclasses.fields(cls):
        if f.init:
            options = f.type.__args__ if isinstance(f.type, types.UnionType) else (f.type,)
            allowed = tuple(typing.get_origin(t) or t for t in options)
            plain = {t for t in allowed if t in (int, float, str, bool, type(None))}
            if float in allowed:   # (an int passes for a float, as it is)
                plain.add(int)
            checks.append((f.name, allowed, frozenset(plain)))
    return tuple(checks)
