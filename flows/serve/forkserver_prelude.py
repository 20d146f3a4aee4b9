"""The first module ``ragline serve``'s forkserver imports (flows/serve/warm.py): it arms the
forkserver's parent-death signal on serve, named by ``RAGLINE_FORKSERVER_OF``. Multiprocessing's
forkserver exits only once no process holds its "alive" pipe, and every process it forked holds one,
so without this a ``kill -9`` of serve would leave the forkserver and its flow runs behind. Imported
anywhere else (no such variable naming the importer's parent), it does nothing."""
from __future__ import annotations

import os

from ragline.flows.ops.parent_death import die_with
from ragline.flows.serve.warm import OWNER_ENV

if (owner := os.environ.get(OWNER_ENV, "")).isdigit() and int(owner) == os.getppid():
    die_with(int(owner))
