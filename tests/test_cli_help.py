"""`--help` is a user's first read: every flag of every subcommand says what it does."""
from __future__ import annotations

import argparse

from tandem.cli import build_parser
from tandem.config import EngineConfig


def _actions(parser: argparse.ArgumentParser, path: str):
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sub in a.choices.items():
                yield from _actions(sub, f"{path} {name}")
        elif a.dest != "help":
            yield path, a


def test_every_flag_has_a_help_line():
    missing = [f"{path}: {a.option_strings or a.dest}" for path, a in _actions(build_parser(), "tandem")
               if not (a.help or "").strip()]
    assert missing == []


def test_every_engine_config_field_has_a_comment():
    helps = EngineConfig.help()
    assert sorted(helps) == sorted(f.name for f in EngineConfig.__dataclass_fields__.values())
