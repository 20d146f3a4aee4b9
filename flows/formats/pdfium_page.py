"""One PDF page's characters and ruling edges read by PDFium (pypdfium2), in pdfplumber's shapes.

pdfplumber reads a page through pdfminer.six, which interprets the content stream in Python and
then turns every character into a dict: about 70 ms a page of text, 15 pages a second. PDFium does
the same in C; this module asks it for each character's box and each path's straight segments and
hands them on as pdfplumber's char and edge dicts (points from the top-left of the page as shown:
the crop box, /Rotate applied), so pdfplumber's word grouping and ruling-line table finder run on
them unchanged.
"""
from __future__ import annotations

import ctypes
import math
import threading
from typing import Any

import pypdfium2 as pdfium
import pypdfium2.raw as pdfium_c

SOFT_HYPHEN = 0x02  # PDFium's mark for a hyphen at a line end
HYPHEN = ord("-")
SPACES = frozenset(map(ord, " \u00a0\u2002\u2003\u2009"))
UPRIGHT = 1e-3  # radians: a character turned less than this from the horizontal (either way) is upright
UNMAPPED = (0, 0xFFFD, 0xFFFE, 0xFFFF)  # no character the glyph maps to
STRAIGHT = 1e-3  # points: a segment whose ends differ less than this across it is horizontal (vertical)
MAX_FORM_DEPTH = 8  # form XObjects nested deeper than this are not looked into for ruling lines
LOCK = threading.Lock()  # one PDFium call at a time in the process


class PageView:
    """Maps PDFium's page space (y up, origin of the PDF's user space) to pdfplumber's: points from
    the top-left corner of the crop box as shown, rotated by /Rotate."""

    def __init__(self, page: Any):
        left, bottom, right, top = page.get_bbox()
        self.raw_width, self.raw_height = right - left, top - bottom
        self.rotation = page.get_rotation() % 360
        self.turn = math.radians(self.rotation)
        turned = self.rotation in (90, 270)
        self.width = self.raw_height if turned else self.raw_width
        self.height = self.raw_width if turned else self.raw_height
        # the affine map (x, y) -> (a x + c y + e, b x + d y + f) from page space to the page as shown
        self.matrix = {0: (1, 0, 0, -1, -left, top), 90: (0, 1, 1, 0, -bottom, -left),
                       180: (-1, 0, 0, 1, right, -bottom), 270: (0, -1, -1, 0, top, right)}[self.rotation]

    def point(self, x: float, y: float) -> tuple[float, float]:
        a, b, c, d, e, f = self.matrix
        return a * x + c * y + e, b * x + d * y + f

    def box(self, left: float, bottom: float, right: float, top: float) -> tuple[float, float, float, float]:
        """(x0, top, x1, bottom) as shown."""
        a, b, c, d, e, f = self.matrix
        xa, ya, xb, yb = a * left + c * bottom + e, b * left + d * bottom + f, a * right + c * top + e, b * right + d * top + f
        return (xa, yb, xb, ya) if xa <= xb and yb <= ya else (min(xa, xb), min(ya, yb), max(xa, xb), max(ya, yb))


def chars(page: Any, view: PageView) -> list[dict]:
    """The page's characters as pdfplumber's char dicts (text, x0, x1, top, bottom, doctop, size,
    upright): PDFium's loose boxes (advance width, font ascent to descent); the spaces and line
    breaks PDFium makes up left out, a line-end hyphen kept as "-"."""
    textpage = page.get_textpage()
    unicode_of, box_of = pdfium_c.FPDFText_GetUnicode, pdfium_c.FPDFText_GetLooseCharBox
    angle_of, size_of = pdfium_c.FPDFText_GetCharAngle, pdfium_c.FPDFText_GetFontSize
    is_generated, box = pdfium_c.FPDFText_IsGenerated, view.box
    try:
        found = []
        rect = pdfium_c.FS_RECTF()
        for n in range(pdfium_c.FPDFText_CountChars(textpage)):
            code = unicode_of(textpage, n)
            if code == SOFT_HYPHEN:
                code = HYPHEN
            elif code in UNMAPPED or code < 32 or (code in SPACES and is_generated(textpage, n) == 1):
                continue  # PDFium makes up spaces and line breaks only, never letters
            if not box_of(textpage, n, rect):
                continue
            x0, top, x1, bottom = box(rect.left, rect.bottom, rect.right, rect.top)
            angle = (angle_of(textpage, n) + view.turn) % math.pi
            found.append({"text": chr(code), "x0": x0, "x1": x1, "top": top, "bottom": bottom, "doctop": top,
                          "size": size_of(textpage, n) or (bottom - top),
                          "upright": angle < UPRIGHT or math.pi - angle < UPRIGHT})
        return found
    finally:
        textpage.close()


def edges(page: Any, view: PageView, limit: int | None = None) -> list[dict]:
    """The horizontal and vertical straight segments of the page's paths (rectangles' sides, lines,
    polygons' sides; form XObjects looked into) as pdfplumber's edge dicts; past ``limit`` edges the
    rest of the page's paths are not read (the caller gives such a page no table finder)."""
    found: list[dict] = []
    identity = (1.0, 0.0, 0.0, 1.0, 0.0, 0.0)
    count = pdfium_c.FPDFPage_CountObjects(page.raw)
    _object_edges([pdfium_c.FPDFPage_GetObject(page.raw, n) for n in range(count)], identity, view, found, 0,
                  math.inf if limit is None else limit)
    return found


def has_paths(page: Any) -> bool:
    """Whether the page draws any path (a table's ruling lines are paths), forms looked into."""
    return any(True for _ in page.get_objects(filter=[pdfium_c.FPDF_PAGEOBJ_PATH], max_depth=MAX_FORM_DEPTH))


def _object_edges(objects: list, outer: tuple, view: PageView, found: list[dict], depth: int,
                  limit: float) -> None:
    matrix = pdfium_c.FS_MATRIX()
    for obj in objects:
        if len(found) > limit:
            return
        kind = pdfium_c.FPDFPageObj_GetType(obj)
        if kind not in (pdfium_c.FPDF_PAGEOBJ_PATH, pdfium_c.FPDF_PAGEOBJ_FORM):
            continue
        if not pdfium_c.FPDFPageObj_GetMatrix(obj, matrix):
            continue
        combined = _compose((matrix.a, matrix.b, matrix.c, matrix.d, matrix.e, matrix.f), outer)
        if kind == pdfium_c.FPDF_PAGEOBJ_FORM:
            if depth < MAX_FORM_DEPTH:
                inner = [pdfium_c.FPDFFormObj_GetObject(obj, n) for n in range(pdfium_c.FPDFFormObj_CountObjects(obj))]
                _object_edges(inner, combined, view, found, depth + 1, limit)
            continue
        _path_edges(obj, combined, view, found)


def _compose(inner: tuple, outer: tuple) -> tuple:
    """The matrix applying ``inner`` then ``outer`` (PDF's row-vector convention)."""
    a, b, c, d, e, f = inner
    A, B, C, D, E, F = outer
    return (a * A + b * C, a * B + b * D, c * A + d * C, c * B + d * D, e * A + f * C + E, e * B + f * D + F)


def _path_edges(path: Any, matrix: tuple, view: PageView, found: list[dict]) -> None:
    a, b, c, d, e, f = matrix
    x, y = ctypes.c_float(), ctypes.c_float()
    start = current = None
    for n in range(pdfium_c.FPDFPath_CountSegments(path)):
        segment = pdfium_c.FPDFPath_GetPathSegment(path, n)
        if not pdfium_c.FPDFPathSegment_GetPoint(segment, x, y):
            continue
        point = view.point(a * x.value + c * y.value + e, b * x.value + d * y.value + f)
        kind = pdfium_c.FPDFPathSegment_GetType(segment)
        if kind == pdfium_c.FPDF_SEGMENT_MOVETO:
            start = point
        elif kind == pdfium_c.FPDF_SEGMENT_LINETO and current is not None:
            _add_edge(current, point, found)
        current = point
        if pdfium_c.FPDFPathSegment_GetClose(segment) and start is not None:
            _add_edge(current, start, found)
            current = start


def _add_edge(p0: tuple[float, float], p1: tuple[float, float], found: list[dict]) -> None:
    if abs(p0[1] - p1[1]) < STRAIGHT and abs(p0[0] - p1[0]) < STRAIGHT:
        return  # a closing segment back to where the path already is
    if abs(p0[1] - p1[1]) < STRAIGHT:
        orientation = "h"
    elif abs(p0[0] - p1[0]) < STRAIGHT:
        orientation = "v"
    else:
        return  # a slanted line rules no table
    x0, x1 = sorted((p0[0], p1[0]))
    top, bottom = sorted((p0[1], p1[1]))
    found.append({"object_type": "curve_edge", "x0": x0, "x1": x1, "top": top, "bottom": bottom, "doctop": top,
                  "width": x1 - x0, "height": bottom - top, "orientation": orientation})


def open_document(data: bytes) -> Any:
    with LOCK:
        return pdfium.PdfDocument(data, password="")


def close_document(document: Any) -> None:
    with LOCK:
        document.close()


def page_count(document: Any) -> int:
    with LOCK:
        return len(document)


def read_page(document: Any, number: int, max_edges: int) -> tuple[PageView, list[dict], list[dict]]:
    """A page's view, characters and ruling edges (none read when it draws no path; reading stops past
    ``max_edges``), the page closed."""
    with LOCK:
        page = document[number]
        try:
            view = PageView(page)
            return view, chars(page, view), (edges(page, view, max_edges) if has_paths(page) else [])
        finally:
            page.close()


__all__ = ["LOCK", "PageView", "chars", "close_document", "edges", "has_paths", "open_document", "page_count",
           "read_page"]
