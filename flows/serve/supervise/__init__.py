"""`ragline serve` as one long-running process: the deployments and their runner (``service``),
flow runs forked warm (``warm``, ``forkserver_prelude``), the folder watchers (``watch``) and where a
running server answers for a project (``discovery``)."""
