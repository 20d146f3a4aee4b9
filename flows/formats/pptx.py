"""PowerPoint decks (.pptx) through python-pptx: one page per slide (so sources cite 'p. 3' for
slide 3), the slide title as a heading, text frames, tables as Markdown tables, speaker notes."""
from __future__ import annotations

import io
from typing import Any, Iterator

from ragline.flows.formats.base import Converted, FormatError, Options, blocks, heading, markdown_table, paged


def convert(data: bytes, name: str, options: Options = Options()) -> Converted:
    from pptx import Presentation  # here: only a .pptx needs it

    try:
        deck = Presentation(io.BytesIO(data))
    except Exception as exc:
        raise FormatError(f"unreadable PPTX (not a PowerPoint package): {type(exc).__name__}: {exc}") from None
    slides: list[str] = []
    size = 0
    for slide in deck.slides:
        options.check(size)  # a slide at a time: the document's time and text budget
        title_shape = slide.shapes.title
        parts = [heading(1, title_shape.text_frame.text)] if title_shape is not None else []
        title_id = title_shape.shape_id if title_shape is not None else None
        parts += [text for shape in slide.shapes if shape.shape_id != title_id for text in _shape_texts(shape)]
        if slide.has_notes_slide and (notes := slide.notes_slide.notes_text_frame.text.strip()):
            parts.append(f"Notes: {notes}")
        slides.append(blocks(parts))
        size += len(slides[-1])
    text, starts = paged(slides)
    first_title = next((s.split("\n", 1)[0].lstrip("# ") for s in slides if s.startswith("# ")), "")
    return Converted(text=text, title=(deck.core_properties.title or "").strip() or first_title, pages=starts,
                     metadata={"pages": len(starts)})


def _shape_texts(shape: Any) -> Iterator[str]:
    if shape.shape_type is not None and hasattr(shape, "shapes"):  # a group: its shapes in order
        for inner in shape.shapes:
            yield from _shape_texts(inner)
    elif getattr(shape, "has_table", False) and shape.has_table:
        yield markdown_table([c.text for c in row.cells] for row in shape.table.rows)
    elif getattr(shape, "has_text_frame", False) and shape.has_text_frame:
        yield shape.text_frame.text
