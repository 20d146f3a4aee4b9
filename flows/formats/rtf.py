"""Rich Text Format (.rtf) through striprtf: the text, without the control words."""
from __future__ import annotations

from ragline.flows.formats.base import Converted, FormatError, Options


def convert(data: bytes, name: str, options: Options = Options()) -> Converted:
    from striprtf.striprtf import rtf_to_text  # here: only an .rtf needs it

    if not data.lstrip().startswith(b"{\\rtf"):
        raise FormatError("not an RTF file: it does not start with '{\\rtf'")
    try:
        text = rtf_to_text(data.decode("latin-1"), errors="replace")  # RTF is 7-bit; \'xx escapes carry the rest
    except Exception as exc:
        raise FormatError(f"unreadable RTF: {type(exc).__name__}: {exc}") from None
    return Converted(text=text.strip())
