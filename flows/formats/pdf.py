"""PDF through pypdf, page by page: the page starts travel with the text, so chunks cite pages."""
from __future__ import annotations

import io

from ragline.flows.formats.base import Converted, FormatError, paged


def convert(data: bytes, name: str) -> Converted:
    from pypdf import PdfReader  # here: only a PDF needs it (`ragline validate` need not import it)

    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted and not reader.decrypt(""):  # an empty user password still opens many
            raise FormatError("encrypted PDF: a password is needed to read it")
        pages = [page.extract_text() or "" for page in reader.pages]
        title = str((reader.metadata.title if reader.metadata else None) or "").strip()
    except FormatError:
        raise
    except Exception as exc:  # pypdf raises many exception types on malformed files
        raise FormatError(f"unreadable PDF: {type(exc).__name__}: {exc}") from None
    text, starts = paged(pages)
    if not text:
        raise FormatError("PDF has no extractable text (scanned images?)")
    return Converted(text=text, title=title, pages=starts, metadata={"pages": len(starts)})
