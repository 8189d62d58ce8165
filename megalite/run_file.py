"""Run files: `--yaml-cfg FILE`, a YAML mapping of megalite's flag names to their values.

Keys are flag names without the leading dashes, with dashes or underscores
(`num-layers`, `num_layers`); they may sit at the top level or in groups (any mapping whose
key is not a flag, e.g. `model:` or `parallelism:`), as the user likes. Values are what the
command line would take: a number, a string, a list for a multi-value flag, true/false for
an on/off flag (`swiglu: true` passes `--swiglu`), null for "unset". The file's values
become the parser's defaults, so a flag given on the command line overrides the file.

Every value is checked as the parser would check it (type, choices, number of values)
before anything runs; a problem is a ConfigError naming the file, the line and the key.
`dump_run_file` writes a run's effective flags back as such a file, grouped as in --help:
TensorBoard's directory and each checkpoint keep one, so any run can be repeated from it.
(Megatron's --yaml-cfg takes its own nested schema; megalite's takes its flags.)
"""

import argparse
import difflib
import os
from pathlib import Path

import yaml

from megalite.atomic_write import atomic_write
from megalite.errors import ConfigError

FLAG = "--yaml-cfg"


def _key(option: str) -> str:
    return option.lstrip("-").replace("-", "_")


def _flag_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Key (underscored flag name) -> its action, for every flag a run file may set."""
    return {_key(option): action for action in parser._actions
            for option in action.option_strings
            if option.startswith("--") and action.dest not in ("help", "yaml_cfg")}


def parse_with_run_file(parser: argparse.ArgumentParser, argv) -> argparse.Namespace:
    """Parse argv; with `--yaml-cfg FILE` in it, the file's values are the defaults."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument(FLAG, default=None)
    known, _ = pre.parse_known_args(argv)
    if known.yaml_cfg is not None:
        parser.set_defaults(**load_run_file(known.yaml_cfg, parser))
    return parser.parse_args(argv)


def load_run_file(path: str, parser: argparse.ArgumentParser) -> dict:
    """{dest: value} of the flags the file sets, each checked as the parser would."""
    try:
        with open(path, encoding="utf-8") as f:
            root = yaml.compose(f, Loader=yaml.SafeLoader)
    except OSError as error:
        raise ConfigError(f"{FLAG} {path}: cannot read it ({error.strerror})") from error
    except yaml.YAMLError as error:
        raise ConfigError(f"{FLAG} {path}: not valid YAML: {error}") from error
    if root is None:
        return {}
    values, where = {}, {}
    _read_mapping(root, path, _flag_actions(parser), values, where)
    return values


def _read_mapping(node, path: str, actions: dict, values: dict, where: dict):
    if not isinstance(node, yaml.MappingNode):
        raise ConfigError(f"{_at(path, node)}: expected a mapping of flag names to values, "
                          f"got {node.tag.rsplit(':', 1)[-1]}")
    for key_node, value_node in node.value:
        key = yaml.safe_load(yaml.serialize(key_node))
        name = _key(str(key))
        if name in actions:
            action = actions[name]
            if action.dest in where:
                raise ConfigError(f"{_at(path, key_node)}: key {key!r} sets the same flag as "
                                  f"line {where[action.dest]}")
            where[action.dest] = key_node.start_mark.line + 1
            values[action.dest] = _convert(action, yaml.safe_load(yaml.serialize(value_node)),
                                           f"{_at(path, key_node)}: {key}")
        elif isinstance(value_node, yaml.MappingNode):
            _read_mapping(value_node, path, actions, values, where)  # a group
        else:
            close = difflib.get_close_matches(name, actions, n=1)
            hint = f" (did you mean {close[0].replace('_', '-')!r}?)" if close else ""
            raise ConfigError(f"{_at(path, key_node)}: unknown key {key!r}: not a "
                              f"pretrain_gpt.py flag{hint}")


def _at(path: str, node) -> str:
    return f"{FLAG} {path}, line {node.start_mark.line + 1}"


def _convert(action: argparse.Action, value, where: str):
    """The value the parser would store for this flag given `value`."""
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        # `flag: true` means the flag is passed: a store_false flag then stores False.
        return value if isinstance(action, argparse._StoreTrueAction) else not value
    if value is None:
        return None
    if action.nargs in ("*", "+"):
        if not isinstance(value, list):
            value = [value]
        if action.nargs == "+" and not value:
            raise ConfigError(f"{where}: expected at least one value")
        return [_scalar(action, v, where) for v in value]
    if isinstance(value, (list, dict)):
        raise ConfigError(f"{where}: expected one value, got {value!r}")
    return _scalar(action, value, where)


def _scalar(action: argparse.Action, value, where: str):
    if value is None or isinstance(value, (bool, list, dict)):
        kind = {int: "an integer", float: "a number"}.get(action.type, "a string")
        raise ConfigError(f"{where}: expected {kind}, got {value!r}")
    if action.type is int and not isinstance(value, int):
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if action.type is float and not isinstance(value, (int, float)):
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    try:
        converted = (action.type or str)(value if action.type in (int, float) else str(value))
    except (TypeError, ValueError, argparse.ArgumentTypeError) as error:
        raise ConfigError(f"{where}: invalid value {value!r}: {error}") from error
    if action.choices is not None and converted not in action.choices:
        raise ConfigError(f"{where}: {converted!r} is not one of "
                          f"{', '.join(map(str, action.choices))}")
    return converted


def dump_run_file(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    """The flags of `args` as a run file `--yaml-cfg` reads back to the same namespace:
    every flag with its value, grouped as in --help."""
    groups = {}
    for group in parser._action_groups:
        entries = {}
        for action in group._group_actions:
            longs = [o for o in action.option_strings if o.startswith("--")]
            if not longs or action.dest in ("help", "yaml_cfg"):
                continue
            value = getattr(args, action.dest)
            if isinstance(action, argparse._StoreFalseAction):
                value = not value  # `--disable-bias-linear: true` stores add_bias_linear False
            entries[longs[0].lstrip("-")] = value
        if entries:
            groups[group.title] = entries
    return yaml.safe_dump(groups, sort_keys=False, default_flow_style=False)


RUN_FILE_NAME = "run_config.yaml"


def write_run_file(directory: str | Path, text: str) -> Path:
    """`directory/run_config.yaml`, written under a temporary name and renamed."""
    path = Path(directory) / RUN_FILE_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda f: f.write(text.encode("utf-8")), suffix=f".tmp-{os.getpid()}")
    return path
