"""Megatron-LM's command-line flags: one parser, grouped as in `--help`, made from where each
flag is declared once: the fields of Config's sections (megalite/config/) and the flags
validation derives fields from (`validation.INPUT_FLAGS`); config/flags.py says how.

Flag names and defaults follow Megatron-LM so scripts port unchanged. `parse_args` only
parses; `megalite.validation.validate_args` turns the namespace into frozen dataclasses and
rejects combinations that cannot work. Nothing here is read as a global.
"""

import argparse

from megalite.config import Config
from megalite.config.flags import add_flags, section_types
from megalite.run_file import parse_with_run_file
from megalite.validation import INPUT_FLAGS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pretrain_gpt.py",
        description="Pretrain a GPT model with megalite (Megatron-LM flags).",
        allow_abbrev=False,
    )
    add_flags(parser, [*section_types(Config), *INPUT_FLAGS])
    parser.add_argument("--yaml-cfg", metavar="FILE",
                        help="A run file: YAML whose keys are these flags' names (grouped or "
                             "flat); flags on the command line override it. Megatron's flag "
                             "name; megalite's meaning (Megatron's file has its own schema).")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    return parse_with_run_file(build_parser(), argv)
