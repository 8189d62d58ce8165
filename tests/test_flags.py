"""Flags declared once (megalite/config/flags.py). pretrain_gpt.py's flags against the parser
megalite had before they were: tests/data/parser_flags.json was written by the hand-written
parser of megalite/arguments.py (`python -m tests.test_flags` wrote it). Every flag there must
still parse the same: its names, namespace attribute, action, default, type, values, --help
group and help text. A flag added since is welcome, with help. And a flag added the one way
a feature adds it, a field with its flag, reaches --help, run files and the Config."""

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import yaml

from megalite.arguments import build_parser, parse_args
from megalite.config import Config, LoggingConfig
from megalite.config.flags import flag
from megalite.run_file import dump_run_file
from megalite.validation import validate_args

from tests.helpers import BASE_FLAGS

SNAPSHOT = Path(__file__).resolve().parent / "data" / "parser_flags.json"
# Changed on purpose: these switches store what they turn off (args.save_optim = False), as
# the config field does, instead of args.no_save_optim = True; the command line and run
# files read as before.
STORE_FALSE = ("--no-save-optim", "--no-load-optim", "--no-load-rng")


def describe(parser) -> dict:
    """The parser as data: its groups in --help order and every flag's properties."""
    groups, flags = [], {}
    for group in parser._action_groups:
        groups.append([group.title, group.description])
        for action in group._group_actions:
            if action.dest == "help":
                continue
            type_name = getattr(action.type, "__name__", action.type)
            flags[action.option_strings[0]] = {
                "option_strings": action.option_strings, "dest": action.dest,
                "action": type(action).__name__, "default": action.default,
                "const": action.const, "nargs": action.nargs,
                # argparse stores a str as given: no type and type=str parse alike.
                "type": None if type_name == "str" else type_name,
                "choices": list(action.choices) if action.choices is not None else None,
                "metavar": action.metavar, "required": action.required,
                "group": group.title, "help": action.help}
    return {"groups": groups, "flags": flags}


def test_every_flag_parses_as_before():
    before, now = json.loads(SNAPSHOT.read_text()), describe(build_parser())
    assert now["groups"] == before["groups"]
    missing = sorted(set(before["flags"]) - set(now["flags"]))
    assert not missing, f"flags gone: {missing}"
    changed = []
    for option, old in before["flags"].items():
        new = json.loads(json.dumps(now["flags"][option]))  # tuples as lists, as in the file
        if old["help"] is None:  # help may be added where there was none
            new["help"] = None
        if option in STORE_FALSE:
            old = {**old, "dest": option[5:].replace("-", "_"), "action": "_StoreFalseAction",
                   "default": True, "const": False}
        changed += [(option, k, old[k], new[k]) for k in old if new[k] != old[k]]
    assert not changed
    added = [o for o, new in now["flags"].items() if o not in before["flags"] and not new["help"]]
    assert not added, f"new flags without help: {added}"


@pytest.fixture
def new_flag(monkeypatch):
    """The one edit that adds a flag: a field, with its flag, in a section of Config (done at
    test time to a subclass, which Config's `logging` field is pointed at)."""
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Logging(LoggingConfig):
        log_loss_scale_interval: int = flag(7, help="Iterations between loss-scale lines.")
    monkeypatch.setattr(Config.__dataclass_fields__["logging"], "type", Logging)


def test_a_flag_declared_once_reaches_help_run_files_and_the_config(new_flag, tmp_path):
    logging_help = build_parser().format_help().split("\nlogging:\n")[1].split("\n\n")[0]
    assert "--log-loss-scale-interval LOG_LOSS_SCALE_INTERVAL" in logging_help
    assert "Iterations between loss-scale lines." in logging_help
    assert validate_args(parse_args(BASE_FLAGS)).logging.log_loss_scale_interval == 7
    args = parse_args(BASE_FLAGS + ["--log-loss-scale-interval", "3"])
    config = validate_args(args)
    assert config.logging.log_loss_scale_interval == 3
    text = dump_run_file(args, build_parser())  # what a checkpoint keeps of the run
    assert yaml.safe_load(text)["logging"]["log-loss-scale-interval"] == 3
    run_file = tmp_path / "run.yaml"
    run_file.write_text(text)
    assert validate_args(parse_args(["--yaml-cfg", str(run_file)])) == config
    run_file.write_text("logging:\n  log_loss_scale_interval: 5\n")
    assert validate_args(parse_args(["--yaml-cfg", str(run_file), *BASE_FLAGS])
                         ).logging.log_loss_scale_interval == 5


if __name__ == "__main__":  # rewrite the snapshot (only when a flag is meant to change)
    SNAPSHOT.write_text(json.dumps(describe(build_parser()), indent=1) + "\n")
    sys.exit(0)
