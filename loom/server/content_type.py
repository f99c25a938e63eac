"""The request bodies the API reads: JSON under a JSON Content-Type (torch-free: the router uses it too)."""

from __future__ import annotations


def is_json_content_type(content_type: str | None) -> bool:
    """True for the media types FastAPI parses a body as JSON under: application/json and application/*+json
    (parameters such as charset ignored, any case)."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def not_json_message(content_type: str | None) -> str:
    """Why a body sent without a JSON Content-Type was not read, and what to send instead."""
    got = "no Content-Type" if not content_type else f"Content-Type {content_type!r}"
    hint = (" (curl -d sends that one unless given -H 'Content-Type: application/json')"
            if content_type and content_type.lower().startswith("application/x-www-form-urlencoded") else "")
    return (f"The request body must be JSON sent with the header 'Content-Type: application/json'; this request has "
            f"{got}{hint}.")
