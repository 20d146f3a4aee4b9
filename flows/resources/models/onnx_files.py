"""Where the embedder's ONNX exports live, importable without torch: the torch-free query encoder
(``onnx_query``) finds the files ``onnx_backend`` writes by the same keys.

Exports go to ``$RAGLINE_CACHE_DIR/onnx/<key>/`` (default ``~/.cache/ragline``), never next to the
model: packaged models live in site-packages, which is not ours to write at run time.
"""
from __future__ import annotations

import hashlib
import platform
from pathlib import Path

from ragline.flows import settings

EXPORT_FORMAT = 1  # bump when the export or quantisation recipe changes, to invalidate old caches


def cache_root() -> Path:
    """Folder holding the ONNX exports; RAGLINE_CACHE_DIR overrides ~/.cache/ragline."""
    base = settings.project().cache_dir
    return Path(base).expanduser() / "onnx"


def quantization_config() -> str:
    """optimum's name for the int8 recipe that suits this CPU: VNNI does u8*s8 dot products in one instruction."""
    if platform.machine().lower() in ("arm64", "aarch64"):
        return "arm64"
    flags = _cpu_flags()
    if "avx512_vnni" in flags:
        return "avx512_vnni"
    if "avx512f" in flags and "avx512bw" in flags:
        return "avx512"
    return "avx2"


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {flag for line in text.splitlines() if line.startswith("flags") for flag in line.split(":", 1)[1].split()}


def cache_dir(path: str, variant: str) -> Path:
    """Cache folder keyed by the model's location, its files' sizes and times, and the variant.

    The file stats make a reinstalled or retrained model at the same path re-export instead of
    serving stale vectors; stat-ing is cheap where hashing 90 MB of weights on every load is not.
    """
    source = Path(path)
    parts = [str(EXPORT_FORMAT), variant, str(source.resolve()) if source.exists() else path]
    if source.is_dir():
        parts += [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in sorted(source.iterdir()) if f.is_file()]
    return cache_root() / hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def fp32_file(path: str) -> Path:
    """The fp32 export of the model at ``path`` (it may not exist yet)."""
    return cache_dir(path, "fp32") / "model.onnx"


def int8_file(path: str) -> Path:
    """The int8 export of the model at ``path`` for this CPU (it may not exist yet)."""
    config = quantization_config()
    return cache_dir(path, f"qint8_{config}") / f"model_qint8_{config}.onnx"
