"""The one exception recompute raises for bad user input."""

from __future__ import annotations

__all__ = ["ConfigError", "distinct", "first_line", "one_of", "positive_int", "require", "torch_seed"]


class ConfigError(ValueError):
    """A configuration or input that recompute cannot use.

    The message is one line that says what was expected, what came, and how to fix it. It speaks in the
    library's field names (``micro_batch must be ...``) and lists them in ``fields``; the CLI prints it with
    each of those names turned into its option (``--micro-batch must be ...``) and exits with code 2. Python
    callers can catch it as a plain ``ValueError``.
    """

    def __init__(self, message: str, *, fields: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.fields = fields
        """The field names the message mentions, for the CLI to show as options."""


def require(condition: bool, message: str, *, fields: tuple[str, ...] = ()) -> None:
    """Raise ``ConfigError(message, fields=fields)`` unless ``condition`` holds."""
    if not condition:
        raise ConfigError(message, fields=fields)


def positive_int(name: str, value: object, *, at_most: int | None = None) -> int:
    """Return ``value`` if it is an int in [1, ``at_most``], else raise a ConfigError naming the field ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}", fields=(name,))
    if at_most is not None and value > at_most:
        raise ConfigError(f"{name} must be at most {at_most:,}, got {value:,}", fields=(name,))
    return value


def torch_seed(name: str, value: object) -> int:
    """Return ``value`` if torch takes it as a seed (an int from -2^63 to 2^64 - 1), else raise a ConfigError
    naming ``name`` (``torch.manual_seed(10**23)`` raised an OverflowError-like ValueError)."""
    if isinstance(value, bool) or not isinstance(value, int) or not -(2**63) <= value < 2**64:
        raise ConfigError(f"{name} must be an integer from -2^63 to 2^64 - 1 (what torch seeds with), got {value!r}")
    return value


def one_of(name: str, value: object, choices: tuple[str, ...]) -> str:
    """Return ``value`` if it is one of ``choices``, else raise a ConfigError naming the field and the choices."""
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}; got {value!r}", fields=(name,))
    return str(value)


def distinct(name: str, values: list[str]) -> list[str]:
    """Return ``values`` if none repeats, else raise a ConfigError naming the option and the first repeat (a list
    of 10,000 copies of one policy was run 10,000 times)."""
    seen: set[str] = set()
    for value in values:
        if value in seen:
            raise ConfigError(f"{name} names {value!r} more than once; give each once", fields=(name,))
        seen.add(value)
    return values


def first_line(e: BaseException) -> str:
    """The first line of an exception's message: what a one-line refusal quotes of a library's error."""
    return (str(e).strip().splitlines() or [""])[0]
