"""The first module ``ragline serve``'s forkserver imports (flows/serve/supervise/warm.py): it arms the
forkserver's parent-death signal on serve, the process that started it. Multiprocessing's forkserver
exits only once no process holds its "alive" pipe, and every process it forked holds one, so without
this a ``kill -9`` of serve would leave the forkserver and its flow runs behind. Imported anywhere
but in a forkserver, it does nothing."""
from __future__ import annotations

import os

from ragline.flows.ops.parent_death import die_with, is_forkserver

if is_forkserver(os.getpid()):
    die_with(os.getppid())
