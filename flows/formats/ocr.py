"""OCR through Debian's tesseract (``tesseract-ocr``) and pytesseract: the text of an image, line by
line, with tesseract's mean word confidence (0..1). Optional: ``unavailable()`` says why it cannot
run, and the converters that need it report that reason instead of failing obscurely."""
from __future__ import annotations

import shutil
from typing import Any


def unavailable() -> str | None:
    """Why OCR cannot run here, or None when it can."""
    try:
        import pytesseract
    except ImportError:
        return "pytesseract is not installed (pip install pytesseract)"
    if shutil.which(pytesseract.pytesseract.tesseract_cmd) is None:
        return "tesseract is not installed (apt-get install tesseract-ocr)"
    return None


def read(image: Any, languages: str = "eng") -> tuple[str, float]:
    """(text, mean confidence 0..1) of a PIL image; paragraphs separated by blank lines."""
    import pytesseract

    found = pytesseract.image_to_data(image.convert("RGB"), lang=languages, output_type=pytesseract.Output.DICT)
    lines: dict[tuple[int, int, int], list[str]] = {}
    confidences = []
    for i, word in enumerate(found["text"]):
        confidence = float(found["conf"][i])
        if word.strip() and confidence >= 0:
            lines.setdefault((found["block_num"][i], found["par_num"][i], found["line_num"][i]), []).append(word)
            confidences.append(confidence)
    text, previous = "", None
    for key, words in lines.items():
        if text:
            text += "\n\n" if key[:2] != previous else "\n"
        text += " ".join(words)
        previous = key[:2]
    return text, (sum(confidences) / len(confidences) / 100 if confidences else 0.0)
