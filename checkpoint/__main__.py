"""`python -m checkpoint VERB ...`: the user commands' old name, kept as an alias of `python -m cli`
(the commands import the rooms above checkpoint/, so they live on the top floor: cli/)."""
import sys

from cli import main

sys.exit(main())
