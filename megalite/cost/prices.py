"""The price table (prices.yaml beside this file, or the user's --prices) and the GPU kinds
of monitoring/peak_flops.py it is keyed by."""

from dataclasses import dataclass
from pathlib import Path

import yaml

from megalite.errors import ConfigError
from megalite.monitoring.peak_flops import PEAK_TFLOPS

DEFAULT_TABLE = Path(__file__).with_name("prices.yaml")


@dataclass(frozen=True)
class Offer:
    """One published price of a GPU kind, USD per GPU-hour."""
    gpu: str
    offer: str
    source: str
    date: str
    on_demand: float | None = None
    spot: float | None = None
    what: str = ""


def gpu_kind(name: str) -> str:
    """PEAK_TFLOPS's key for `name` (--gpu), matched without regard to case."""
    for key in PEAK_TFLOPS:
        if key.lower() == name.strip().lower():
            return key
    raise ConfigError(f"--gpu {name!r}: unknown GPU kind; known: {', '.join(PEAK_TFLOPS)} "
                      "(megalite/monitoring/peak_flops.py; --peak-tflops gives another's peak)")


def load_offers(path: str | Path = DEFAULT_TABLE) -> dict[str, list[Offer]]:
    """The table's offers by GPU kind, in the file's order. Raises ConfigError naming
    --prices and the entry that is wrong."""
    try:
        table = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"--prices {path}: cannot read the price table: {e}") from None
    if not isinstance(table, dict):
        raise ConfigError(f"--prices {path}: expected GPU kinds mapped to lists of offers")
    offers = {}
    for gpu, entries in table.items():
        if gpu not in PEAK_TFLOPS:
            raise ConfigError(f"--prices {path}: unknown GPU kind {gpu!r}; known: "
                              f"{', '.join(PEAK_TFLOPS)}")
        offers[gpu] = [_offer(path, gpu, entry) for entry in entries or []]
    return offers


def _offer(path, gpu: str, entry) -> Offer:
    fields = Offer.__dataclass_fields__.keys() - {"gpu"}  # the kind is the entry's key
    if not isinstance(entry, dict) or not {"offer", "source", "date"} <= entry.keys() \
            or entry.keys() - fields:
        raise ConfigError(f"--prices {path}: {gpu}: each offer needs offer, source and date, "
                          f"and may have on_demand, spot and what; got {entry!r}")
    for price in ("on_demand", "spot"):
        value = entry.get(price)
        if value is not None and (not isinstance(value, (int, float)) or value <= 0):
            raise ConfigError(f"--prices {path}: {gpu} {entry['offer']}: {price} must be a "
                              f"positive number of USD per GPU-hour, got {value!r}")
    return Offer(gpu=gpu, **{**entry, "date": str(entry["date"])})


def find_offer(offers: dict[str, list[Offer]], gpu: str, name: str | None,
               path) -> Offer | None:
    """The offer --offer names for `gpu` (its first one by default); None if the table has
    none for that kind."""
    listed = offers.get(gpu, [])
    if name is None:
        return listed[0] if listed else None
    for offer in listed:
        if offer.offer == name:
            return offer
    raise ConfigError(f"--offer {name!r}: no such offer for {gpu} in {path}; listed: "
                      f"{', '.join(o.offer for o in listed) or 'none'}")
