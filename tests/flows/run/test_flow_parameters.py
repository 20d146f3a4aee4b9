"""``run_pipeline``'s parameters as its flow run records them (what the dashboard shows): the same
as Prefect's own encoding, without the FastAPI import that encoding costs (issue 22 item 5)."""
from __future__ import annotations

import math
import subprocess
import sys


def test_parameters_are_recorded_as_prefects_encoder_records_them():
    from fastapi.encoders import jsonable_encoder

    from ragline.flows.contracts import Query
    from ragline.flows.run.entrypoints import run_pipeline

    given = {"pipeline": "search", "inputs": {"query": Query(text="hello", filters={"year": 2020})},
             "file": "/p/pipelines.yaml", "overrides": {"load": {"paths": ["/a", "/b"]}, "k": {"x": 0.5}},
             "resources": {}, "data_dir": None}
    assert run_pipeline.serialize_parameters(given) == {k: jsonable_encoder(v) for k, v in given.items()}
    odd = {"pipeline": "p", "inputs": {"score": math.nan, "when": object()}}  # not JSON: Prefect's own encoding
    assert run_pipeline.serialize_parameters(odd)["inputs"].startswith("<")  # its placeholder for the unencodable


def test_serializing_a_flow_runs_parameters_imports_no_fastapi():
    code = ("import sys\nfrom ragline.flows.contracts import Query\nfrom ragline.flows.run.entrypoints import run_pipeline\n"
            "run_pipeline.serialize_parameters({'pipeline': 'p', 'inputs': {'query': Query(text='q')}})\n"
            "print('fastapi' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"


def test_the_flow_pickles_as_prefects_runner_and_dask_send_it():
    """Prefect's runner and a Dask cluster send the flow with cloudpickle, which takes this module's
    globals by value: a module-level name bound to a ContextVar (not picklable) crashes every served
    run. Names like that are reached through their module (``step_context.QUERY_VECTORS``)."""
    import cloudpickle

    from ragline.flows.run.entrypoints import run_pipeline

    assert cloudpickle.loads(cloudpickle.dumps(run_pipeline)).name == run_pipeline.name
