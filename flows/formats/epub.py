"""EPUB books through EbookLib: the chapters in reading (spine) order, each XHTML page as Markdown."""
from __future__ import annotations

import io
import warnings

from ragline.flows.formats.base import Converted, FormatError, Options, blocks, html_markdown


def convert(data: bytes, name: str, options: Options = Options()) -> Converted:
    from ebooklib import epub  # here: only an .epub needs it

    try:
        with warnings.catch_warnings():  # EbookLib warns about its own future defaults on every read
            warnings.simplefilter("ignore")
            book = epub.read_epub(io.BytesIO(data), options={"ignore_ncx": True})
    except Exception as exc:
        raise FormatError(f"unreadable EPUB (not an EPUB package): {type(exc).__name__}: {exc}") from None
    chapters: list[str] = []
    size = 0
    for item_id, _linear in book.spine:
        options.check(size)  # a chapter at a time: the document's time and text budget
        item = book.get_item_with_id(item_id)
        if item is not None:
            chapters.append(html_markdown(item.get_content())[0])
            size += len(chapters[-1])
    titles = book.get_metadata("DC", "title")
    return Converted(text=blocks(chapters), title=str(titles[0][0]).strip() if titles else "")
