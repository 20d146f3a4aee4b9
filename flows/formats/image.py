"""Scanned images (.png, .jpg, .jpeg, .tif, .tiff) through OCR: one page per image frame (a
multi-page TIFF is a multi-page document), with the mean OCR confidence in the metadata."""
from __future__ import annotations

import io

from ragline.flows.formats import ocr
from ragline.flows.formats.base import Converted, FormatError, Options, paged


def convert(data: bytes, name: str, options: Options = Options()) -> Converted:
    if not options.ocr:
        raise FormatError("an image is read by OCR, which this step turns off (ocr: false)")
    if (reason := ocr.unavailable()) is not None:
        raise FormatError(f"an image is read by OCR, which is not available: {reason}")
    from PIL import Image, ImageSequence, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        frames = [frame.copy() for _, frame in zip(range(options.ocr_max_pages), ImageSequence.Iterator(image))]
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise FormatError(f"unreadable image: {type(exc).__name__}: {exc}") from None
    pages, confidences = [], []
    for frame in frames:
        text, confidence = ocr.read(frame, options.ocr_languages)
        pages.append(text)
        confidences.append(confidence)
    text, starts = paged(pages)
    if not text:
        raise FormatError("OCR found no text in the image")
    return Converted(text=text, pages=starts if len(starts) > 1 else [],
                     metadata={"ocr_pages": len(frames), "ocr_confidence": round(sum(confidences) / len(confidences), 3)})
