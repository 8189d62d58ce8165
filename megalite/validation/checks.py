"""The checks every part of the validation shares: required and positive flags, fractions,
each naming the flag as the user typed it."""

from megalite.config.flags import flag_name
from megalite.errors import ConfigError


def require(args, *names):
    missing = [flag_name(n) for n in names if getattr(args, n) is None]
    if missing:
        raise ConfigError(f"missing required flag(s): {', '.join(missing)}")


def check_positive(args, *names):
    for name in names:
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ConfigError(f"{flag_name(name)} must be positive, got {value}")


def check_fraction(args, *names):
    for name in names:
        if not 0.0 <= getattr(args, name) < 1.0:
            raise ConfigError(f"{flag_name(name)} must be in [0, 1), got {getattr(args, name)}")
