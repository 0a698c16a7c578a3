"""Where a run's output file stands: ``missing``, ``running`` (resumable) or ``complete``.

``mpitp run`` skips or resumes a run by it, a sweep skips a checkpoint by it and ``mpitp submit --status`` reports it.
"""

from __future__ import annotations

import os

from mpitp.errors import UsageError


def output_status(path: str) -> str:
    """``missing``, ``complete`` or ``running`` for a run's output file.

    Anything else there (a file HDF5 cannot open, an HDF5 file without mpitp's ``status``) is refused, never
    overwritten: it may be another program's data, or results a damaged copy still holds.
    """
    if not os.path.exists(path):
        return "missing"
    from mpitp.results.schema import open_h5  # h5py: only when there is a file to read

    try:
        with open_h5(path) as f:
            status = f.attrs.get("status")
    except (OSError, ValueError, RuntimeError) as exc:  # ValueError: refused (mpitp.results.untrusted)
        reason = " ".join(str(exc).split())[:200]
        raise UsageError(f"output {path} exists and is not an mpitp results file ({reason}); mpitp run does not "
                         f"overwrite it: move it away or delete it") from None
    if isinstance(status, bytes):
        status = status.decode("utf-8", "replace")
    if status not in ("complete", "running"):
        what = "no 'status' attribute" if status is None else f"status {status!r}"
        raise UsageError(f"output {path} exists and is not an mpitp results file ({what}); mpitp run does not "
                         f"overwrite it: move it away or delete it")
    return str(status)
