"""The one settings reader of the owner's machine: ``RUNSTEAD_*`` environment variables.

Strict: a variable that is unset or blank gives the default; any other value must parse,
or ``SettingError`` says which variable and what it held (never a silent default). Imports
only ``os``: the launcher and the hooks' sender load it.
"""
import os


class SettingError(ValueError):
    """A ``RUNSTEAD_*`` variable holds a value its setting cannot take."""


def env_float(name: str, default: float, *, environ=None, minimum: float | None = None) -> float:
    """The finite number (seconds, unless the setting says otherwise) in the variable
    ``name`` of ``environ`` (default ``os.environ``), or ``default`` when it is unset or
    blank. ``minimum``: the smallest value allowed. Raises ``SettingError`` for anything
    else (not a number, NaN, infinite, below ``minimum``)."""
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None or not str(raw).strip():
        return default
    try:
        value = float(raw)
    except ValueError:
        value = None
    if value is None or value != value or value in (float("inf"), float("-inf")):
        raise SettingError(f"{name} must be a number of seconds, got {raw!r}")
    if minimum is not None and value < minimum:
        raise SettingError(f"{name} must be at least {minimum:g}, got {raw!r}")
    return value
