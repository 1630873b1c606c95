"""
The command line, C{rhapsode}: its parser and subcommands (L{commands}) and the install
subcommands with their progress display (L{install}).
"""

from .commands import main

__all__ = ["main"]
