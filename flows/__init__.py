"""ragline's engine: pipelines.yaml -> validated, compiled Prefect flows.

Importing this package sets offline, private defaults before Prefect, Chroma or Hugging Face
load: no analytics or telemetry, no hub downloads for packaged models, and passive OpenMP
waiting (spinning threads slow torch ~10x on a busy 2-core machine). Each can be overridden
by setting the variable yourself.
"""
import os

OFFLINE_DEFAULTS = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "ANONYMIZED_TELEMETRY": "False",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
    "OMP_WAIT_POLICY": "PASSIVE",
    "TOKENIZERS_PARALLELISM": "false",
}
for _key, _value in OFFLINE_DEFAULTS.items():
    os.environ.setdefault(_key, _value)
