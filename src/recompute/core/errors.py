"""The one exception recompute raises for bad user input."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A configuration or input that recompute cannot use.

    The message is one line that says what was expected, what came, and how to fix it. The CLI prints it
    as it is and exits with code 2; Python callers can catch it as a plain ``ValueError``.
    """


def require(condition: bool, message: str) -> None:
    """Raise ``ConfigError(message)`` unless ``condition`` holds."""
    if not condition:
        raise ConfigError(message)


def positive_int(name: str, value: object) -> int:
    """Return ``value`` if it is an int > 0, else raise a ConfigError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return value


def one_of(name: str, value: object, choices: tuple[str, ...]) -> str:
    """Return ``value`` if it is one of ``choices``, else raise a ConfigError listing them."""
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
    return str(value)
