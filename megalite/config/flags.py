"""Each flag declared once (docs/design.md §25): a config field carries its command-line flag,
and the parser, the run file (--yaml-cfg) and the copy of parsed flags into configs are made
from the fields.

    rotary_base: int = flag(10000, help="RoPE base.")

declares --rotary-base, an int (the field's type), 10000 when not given, in the --help group
of its class (`GROUP`). A bool field is a switch: --name turns on one that defaults to False;
one that defaults to True is turned off by a flag that says so (--no-..., --disable-...);
`bool | None` takes --name and --no-name (None when neither is given).
"""

import argparse
import dataclasses
import typing
from dataclasses import MISSING, fields, is_dataclass

FLAG = "megalite.flag"  # the key of a field's metadata that holds its flag
AS_FIELD = object()  # flag(unset=): the parser's default is the field's

GROUPS = {  # key: (title, description); --help shows them, and a run file has them, in order
    "model": ("model", None), "parallelism": ("parallelism", None),
    "training": ("training", None), "lr": ("learning rate", None),
    "precision": ("mixed precision", None), "data": ("data", None),
    "checkpointing": ("checkpointing", None), "logging": ("logging", None),
    "distributed": ("distributed", None), "monitoring": ("monitoring", None),
    "fsdp": ("fully sharded data parallelism", None), "fp8": ("fp8", None),
    "uneven": ("uneven pipeline stages and data-parallel shares", None),
    "async_save": ("asynchronous and non-persistent checkpoints", None),
    "wandb": ("weights & biases", None),
    "grad_compression": ("gradient compression (megalite's own flags; Megatron-LM has no such "
                         "feature: names follow torch's PowerSGDState)", None),
    "moe": ("mixture of experts", None),
    "kernels": ("Megatron's kernel switches",
                "Megatron's flags for its fused kernels and model code, accepted so that its "
                "launch scripts run unchanged. megalite has one implementation of each layer; "
                "on a GPU --compile-layers (the default there) fuses the norm, RoPE, "
                "activation, bias and dropout chains, and attention runs in fused kernels "
                "with an fp32 softmax."),
}


def flag(default=MISSING, option: str | None = None, *, group: str | None = None,
         unset=AS_FIELD, **argparse_kwargs):
    """A field with its flag. `option`: the flag's name when it is not --field-name (Megatron's
    name where Megatron has the flag); `group`: a key of GROUPS, when not the class's GROUP;
    `unset`: what parsing gives when the flag is not given, when that is not the field's
    default (None for a field without one): the value validation derives the field from;
    `help`, `choices`, `nargs`, `metavar`, `const`, `type` (the field's int or float unless
    given): as argparse takes them."""
    return dataclasses.field(default=default, metadata={FLAG: dict(
        option=option, group=group, unset=unset, argparse=argparse_kwargs)})


def section_types(cls) -> list[type]:
    """The dataclasses of `cls`'s fields (Config's sections), in order."""
    return [t for t in map(_dataclass_in, (f.type for f in fields(cls))) if t is not None]


def add_flags(parser: argparse.ArgumentParser, classes) -> None:
    """Every flag of `classes`' fields on `parser`, each in its --help group."""
    by_group = {key: [] for key in GROUPS}  # added in --help's order, the usage line's too
    for cls in classes:
        for f in fields(cls):
            if FLAG in f.metadata:
                by_group[f.metadata[FLAG]["group"] or cls.GROUP].append(f)
    for key, group_fields in by_group.items():
        group = parser.add_argument_group(*GROUPS[key])
        for f in group_fields:
            group.add_argument(_option(f), **_arguments(f))


def from_flags(cls, args: argparse.Namespace, **derived):
    """`cls` from the parsed flags: each field as `derived` gives it, else its flag's value, else
    (a section, such as Config's `logging`) built from the flags in turn; a dict in `derived`
    is a section's derived fields, the rest of it from the flags."""
    values = {}
    for f in fields(cls):
        value = derived.get(f.name, {} if is_dataclass(f.type) else MISSING)
        if isinstance(value, dict):
            value = from_flags(_dataclass_in(f.type), args, **value)
        elif value is MISSING and FLAG in f.metadata:
            value = getattr(args, _arguments(f)["dest"])
            value = tuple(value) if isinstance(value, list) else value  # nargs: frozen
        if value is not MISSING:
            values[f.name] = value
    return cls(**values)


def flag_name(name: str) -> str:
    """The flag of a field (or of a parsed flag's attribute) named `name`, as argparse has it."""
    return "--" + name.replace("_", "-")


def _option(f: dataclasses.Field) -> str:
    return f.metadata[FLAG]["option"] or flag_name(f.name)


def _arguments(f: dataclasses.Field) -> dict:
    """argparse's keyword arguments for the flag of `f`."""
    spec, option = f.metadata[FLAG], _option(f)
    dest, given = option.removeprefix("--").replace("-", "_"), spec["argparse"]
    if f.type is bool and f.default:  # --no-x stores False into x, --disable-x into the field
        dest = dest.removeprefix("no_") if option.startswith("--no-") else f.name
        return dict(dest=dest, action="store_false", **given)
    if f.type is bool:
        return dict(dest=dest, action="store_true", **given)
    unset = spec["unset"] if spec["unset"] is not AS_FIELD else (
        None if f.default is MISSING else f.default)
    if f.type == bool | None:
        return dict(dest=dest, action=argparse.BooleanOptionalAction, default=unset, **given)
    return {"dest": dest, "default": unset, "type": _number(f.type), **given}


def _number(annotation) -> type | None:
    """int or float for a field of either (or None of it, or a tuple of it), else None: the
    parser keeps the string."""
    inner = [a for a in typing.get_args(annotation) if a not in (type(None), Ellipsis)]
    kind = inner[0] if inner else annotation
    return kind if kind in (int, float) else None


def _dataclass_in(annotation) -> type | None:
    """The dataclass an annotation names (`X` or `X | None`), else None."""
    for kind in (annotation, *typing.get_args(annotation)):
        if isinstance(kind, type) and is_dataclass(kind):
            return kind
    return None
