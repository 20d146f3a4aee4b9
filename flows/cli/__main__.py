"""`python -m ragline.flows.cli`: the `ragline` command."""
import sys

from ragline.flows.cli import main

sys.exit(main())
