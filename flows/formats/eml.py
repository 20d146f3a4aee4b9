"""E-mail messages (.eml) through the standard library: the headers that say who and when, the
plain-text body (else the HTML one as Markdown), and the attachments as files of their own."""
from __future__ import annotations

import email
from email import policy
from email.message import EmailMessage

from ragline.flows.formats.base import Attachment, Converted, FormatError, Options, blocks, html_markdown

SHOWN_HEADERS = ("From", "To", "Cc", "Date")


def convert(data: bytes, name: str, options: Options = Options()) -> Converted:
    message = email.message_from_bytes(data, policy=policy.default)
    if not isinstance(message, EmailMessage) or not any(message.get(h) for h in ("From", "Subject", "Date",
                                                                                 "Message-ID", "To")):
        raise FormatError("not an e-mail message: no From, To, Subject, Date or Message-ID header")
    subject = " ".join(str(message.get("Subject", "")).split())
    header_lines = "\n".join(f"{h}: {' '.join(str(message[h]).split())}" for h in SHOWN_HEADERS if message.get(h))
    return Converted(text=blocks([header_lines, _body(message)]), title=subject,
                     attachments=list(_attachments(message)))


def _body(message: EmailMessage) -> str:
    part = message.get_body(preferencelist=("plain", "html"))
    if part is None:
        return ""
    try:
        content = part.get_content()
    except (LookupError, ValueError):  # an unknown charset: the bytes as UTF-8, damaged bytes replaced
        content = (part.get_payload(decode=True) or b"").decode("utf-8", "replace")
    return html_markdown(content)[0] if part.get_content_subtype() == "html" else str(content)


def _attachments(message: EmailMessage):
    for number, part in enumerate(message.iter_attachments(), start=1):
        if part.get_content_type() == "message/rfc822":  # a forwarded message: its own .eml document
            inner = part.get_payload(0) if part.is_multipart() else part.get_content()
            yield Attachment(part.get_filename() or f"message-{number}.eml", inner.as_bytes())
            continue
        payload = part.get_payload(decode=True)
        if payload:
            yield Attachment(part.get_filename() or f"attachment-{number}", payload)
