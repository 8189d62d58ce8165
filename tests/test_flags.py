"""pretrain_gpt.py's flags against the parser megalite had before they were declared once
(issue 40): tests/data/parser_flags.json was written by the hand-written parser of
megalite/arguments.py (`python -m tests.test_flags` wrote it). Every flag there must still
parse the same: its names, namespace attribute, action, default, type, values, --help group
and help text. A flag added since is welcome, with help."""

import json
import sys
from pathlib import Path

from megalite.arguments import build_parser

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


if __name__ == "__main__":  # rewrite the snapshot (only when a flag is meant to change)
    SNAPSHOT.write_text(json.dumps(describe(build_parser()), indent=1) + "\n")
    sys.exit(0)
