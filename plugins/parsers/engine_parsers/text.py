"""What the tool parsers share: text up to a marker, with the tail that may begin one held."""

from __future__ import annotations

from engine.parsers import hold_back


def until_marker(buf: str, markers: tuple[str, ...], final: bool):
    """``(text before the first marker, the marker, the text after it)``; with no marker in
    ``buf``: ``(what is surely text, None, the tail held back)`` (nothing is held when
    ``final``: the output ended)."""
    best = None
    for marker in markers:
        i = buf.find(marker)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, marker)
    if best is not None:
        i, marker = best
        return buf[:i], marker, buf[i + len(marker):]
    keep = 0 if final else hold_back(buf, markers)
    return buf[:len(buf) - keep], None, buf[len(buf) - keep:]


def starts(buf: str, marker: str, final: bool):
    """Whether ``buf`` (its leading whitespace aside) begins with ``marker``: True, False, or
    None while it may still (a prefix of it, or only whitespace so far)."""
    s = buf.lstrip()
    if s.startswith(marker):
        return True
    if not final and marker.startswith(s):
        return None
    return False
