"""Command-line parsing shared by the user commands (launch, verify, export): a mistake on the command line is a
UsageError, reported once by rank 0 as one error line like every other user error."""

from __future__ import annotations

import argparse


class UsageError(ValueError):
    """A command-line mistake: an unknown flag, a missing config path, a value of the wrong type."""


class CliParser(argparse.ArgumentParser):
    """argparse that raises UsageError instead of printing the usage and exiting, so a typo in a torchrun
    command is reported once, by rank 0, like every other user error."""

    def error(self, message: str):
        raise UsageError(f"{message} (command line); see {self.prog} --help")
