"""Run every corpus line through lm-eval's own CLI code in this one process: ``python dropin_ref_driver.py LINES``.

``LINES`` is a JSON file of ``[name, argv]``. This is ``lm_eval <argv>`` (HarnessCLI, its run command, its
EvaluationTracker), with one change that does not touch results: the TaskManager does not index lm-eval's ~14k stock
task files when an include path is given (every corpus task is in it), which saves ~10 s per line.
"""

from __future__ import annotations

import json
import sys
import traceback


def main(path: str) -> int:
    from lm_eval._cli import HarnessCLI
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import setup_logging

    original = TaskManager.__init__

    def without_stock_index(self, verbosity=None, include_path=None, include_defaults=True, metadata=None, **kw):
        original(self, verbosity=verbosity, include_path=include_path,
                 include_defaults=include_defaults and not include_path, metadata=metadata, **kw)

    TaskManager.__init__ = without_stock_index
    setup_logging()
    failed = 0
    for name, argv in json.load(open(path)):
        print(f"=== lm-eval {name}: {' '.join(argv)}", flush=True)
        sys.argv = ["lm_eval", *argv]
        try:
            cli = HarnessCLI()
            cli.execute(cli.parse_args())
        except BaseException:  # noqa: BLE001 - record and go on to the next line
            failed += 1
            traceback.print_exc()
            print(f"=== FAILED {name}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
