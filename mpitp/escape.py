"""Text that came from elsewhere (a results file, a journal, an exception quoting a file's names) made safe to print.

Why a module of its own, with no mpitp imports: :mod:`mpitp.errors`, the lowest floor, escapes every usage error it
prints, and the readers of untrusted files (:mod:`mpitp.results.untrusted`, which re-exports :func:`shown`) escape
what they show; both must be able to import it without importing anything above them.
"""

from __future__ import annotations

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def shown(text: object, keep_newlines: bool = False) -> str:
    """``text`` safe to print: every character that is not printable (C0/C1 controls, DEL, bidi overrides, line
    and paragraph separators...) as ``\\n``, ``\\xNN``, ``\\uNNNN`` or ``\\UNNNNNNNN``; newlines kept when asked
    (for text that is ours and spans lines). Plain printable text comes back unchanged, so a file cannot retitle
    the terminal, clear it or reorder what is printed."""
    text = str(text)
    if text.isprintable():
        return text
    out = []
    for ch in text:
        if ch.isprintable() or (keep_newlines and ch == "\n"):
            out.append(ch)
        elif ch in _NAMED:
            out.append(_NAMED[ch])
        else:
            code = ord(ch)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
    return "".join(out)
