"""PDF through pypdf, page by page: the page starts travel with the text, so chunks cite pages. A
page without a text layer (a scan) is read by OCR from its images, up to ``ocr_max_pages`` a file."""
from __future__ import annotations

import io
from typing import Any

from ragline.flows.formats import ocr
from ragline.flows.formats.base import Converted, FormatError, Options, paged


def convert(data: bytes, name: str, options: Options = Options()) -> Converted:
    from pypdf import PdfReader  # here: only a PDF needs it (`ragline validate` need not import it)

    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted and not reader.decrypt(""):  # an empty user password still opens many
            raise FormatError("encrypted PDF: a password is needed to read it")
        pages = [page.extract_text() or "" for page in reader.pages]
        title = str((reader.metadata.title if reader.metadata else None) or "").strip()
        metadata, why_not = _ocr_scans(reader, pages, options)
    except FormatError:
        raise
    except Exception as exc:  # pypdf raises many exception types on malformed files
        raise FormatError(f"unreadable PDF: {type(exc).__name__}: {exc}") from None
    text, starts = paged(pages)
    if not text:
        raise FormatError("PDF has no extractable text (scanned images?)" + (f"; {why_not}" if why_not else ""))
    return Converted(text=text, title=title, pages=starts, metadata={"pages": len(starts), **metadata})


def _ocr_scans(reader: Any, pages: list[str], options: Options) -> tuple[dict[str, int | float], str]:
    """OCR the pages without text that carry images, in place; (metadata, why OCR did not run)."""
    scanned = [n for n, text in enumerate(pages) if not text.strip() and reader.pages[n].images]
    if not scanned:
        return {}, ""
    if not options.ocr:
        return {}, "OCR is turned off (ocr: false)"
    if (reason := ocr.unavailable()) is not None:
        return {}, f"OCR is not available: {reason}"
    confidences = []
    for n in scanned[:options.ocr_max_pages]:
        texts = []
        for picture in reader.pages[n].images:
            text, confidence = ocr.read(picture.image, options.ocr_languages)
            if text:
                texts.append(text)
                confidences.append(confidence)
        pages[n] = "\n\n".join(texts)
    metadata: dict[str, int | float] = {"ocr_pages": min(len(scanned), options.ocr_max_pages)}
    if confidences:
        metadata["ocr_confidence"] = round(sum(confidences) / len(confidences), 3)
    skipped = len(scanned) - options.ocr_max_pages
    if skipped > 0:
        metadata["ocr_skipped_pages"] = skipped
    return metadata, (f"{skipped} scanned pages over the ocr_max_pages budget of {options.ocr_max_pages}"
                      if skipped > 0 else "")
