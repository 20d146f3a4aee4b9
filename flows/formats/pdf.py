"""PDF through pypdf, page by page: the page starts travel with the text, so chunks cite pages. A
page without a text layer (a scan) is read by OCR from its images, up to ``ocr_max_pages`` a file."""
from __future__ import annotations

import io
from typing import Any

from ragline.flows.formats import ocr
from ragline.flows.formats.base import Converted, FormatError, Options, paged


def convert(data: bytes, name: str, options: Options = Options()) -> Converted:
    from pypdf import PdfReader, apply_configuration  # here: only a PDF needs it (`ragline validate` need not)
    from pypdf.errors import LimitReachedError

    try:
        with apply_configuration(**_stream_limits(options)):  # this thread's reads only (a context variable)
            reader = PdfReader(io.BytesIO(data))
            if reader.is_encrypted and not reader.decrypt(""):  # an empty user password still opens many
                raise FormatError("encrypted PDF: a password is needed to read it")
            pages = _page_texts(reader, options)
            title = str((reader.metadata.title if reader.metadata else None) or "").strip()
            metadata, why_not = _ocr_scans(reader, pages, options)
    except FormatError:
        raise
    except LimitReachedError as exc:  # a stream that inflates past the limit, refused while inflating it
        raise FormatError(f"a PDF stream inflates past the document_max_member_bytes limit of "
                          f"{options.max_member_bytes} bytes ({exc})") from None
    except Exception as exc:  # pypdf raises many exception types on malformed files
        raise FormatError(f"unreadable PDF: {type(exc).__name__}: {exc}") from None
    text, starts = paged(pages)
    if not text:
        raise FormatError("PDF has no extractable text (scanned images?)" + (f"; {why_not}" if why_not else ""))
    return Converted(text=text, title=title, pages=starts, metadata={"pages": len(starts), **metadata})


def _stream_limits(options: Options) -> dict[str, int]:
    """pypdf's own limits on what one stream may inflate to (every filter), set to the document's."""
    limit = options.max_member_bytes
    return {key: limit for key in ("zlib_maximum_output_length", "lzw_maximum_output_length",
                                   "run_length_maximum_output_length", "jbig2_maximum_output_length",
                                   "brotli_maximum_output_length", "array_based_stream_maximum_output_length",
                                   "maximum_declared_stream_length", "image_maximum_buffer_size")}


def _page_texts(reader: Any, options: Options) -> list[str]:
    """Each page's text, the document's time and text budget checked before each page."""
    pages: list[str] = []
    size = 0
    for page in reader.pages:
        options.check(size)
        pages.append(page.extract_text() or "")
        size += len(pages[-1])
    return pages


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
        options.check()  # seconds a page: the document's time budget
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
