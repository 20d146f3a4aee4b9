"""`python -m ragline.flows.cli`: the `ragline` command."""
from ragline.flows.cli import run

run()
