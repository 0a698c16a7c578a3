"""Imports put off by the console command (mpitp.importpolicy): transformers' model code imported without scipy's
optimiser, which then comes on its first call, the same function; nothing of the policy left behind. Each case in a
fresh interpreter (the test process has imported transformers already)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mpitp import importpolicy


def _python(code: str, **env: str) -> dict:
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, **env})
    assert p.returncode == 0, p.stderr[-2000:]
    return dict(json.loads(p.stdout.strip().splitlines()[-1]), stderr=p.stderr)


_AFTER = (  # what a run imports: lm-eval's evaluator, HF model, tasks and metrics, transformers' model code, datasets
    "import json, sys\n"
    "import lm_eval.evaluator, lm_eval.models.huggingface, lm_eval.tasks, lm_eval.api.metrics, lm_eval.utils\n"
    "import transformers.modeling_utils, datasets\n"
    "from transformers.loss import loss_for_object_detection as od, loss_utils\n"
    "state = dict(before='scipy.optimize' in sys.modules, requests='requests' in sys.modules,\n"
    "             finders=[type(f).__module__ for f in sys.meta_path],\n"
    "             loader=type(loss_utils.__loader__).__module__, spec=type(loss_utils.__spec__.loader).__module__)\n"
    "rows, cols = od.linear_sum_assignment([[4.0, 1.0, 3.0], [2.0, 0.0, 5.0], [3.0, 2.0, 2.0]])\n"
    "import scipy.optimize\n"
    "real = scipy.optimize.linear_sum_assignment([[4.0, 1.0, 3.0], [2.0, 0.0, 5.0], [3.0, 2.0, 2.0]])\n"
    "state.update(called=[rows.tolist(), cols.tolist()], real=[real[0].tolist(), real[1].tolist()],\n"
    "             module=type(scipy.optimize).__name__, forwarded=od.linear_sum_assignment is not\n"
    "             scipy.optimize.linear_sum_assignment)\n"
    "session = lm_eval.utils.requests.Session()\n"
    "import requests\n"
    "state.update(session=type(session) is requests.Session,\n"
    "             error=lm_eval.utils.requests.RequestException is requests.RequestException)\n"
    "print(json.dumps(state))\n")


def test_a_run_imports_without_scipy_optimize_or_requests_and_calls_the_real_ones():
    """What a run imports loads neither scipy's optimiser nor ``requests`` under the policy; the first call of the
    forwarded function, and the first name read of ``lm_eval.utils.requests``, are the real modules'."""
    got = _python("from mpitp import importpolicy\nimportpolicy.start_up()\n" + _AFTER)
    assert got["before"] is False  # put off: transformers' model code imported, scipy.optimize not
    assert got["requests"] is False and got["session"] is True and got["error"] is True
    assert "mpitp.importpolicy" not in got["finders"]  # the finder left once it had covered every module
    assert got["loader"] != "mpitp.importpolicy" and got["spec"] != "mpitp.importpolicy"
    assert got["called"] == got["real"] == [[0, 1, 2], [1, 0, 2]]
    assert got["module"] == "module" and got["forwarded"] is True  # the real module in sys.modules afterwards


def test_without_the_policy_a_run_imports_scipy_optimize_and_requests():
    """The control: what the policy saves is there to save (a transformers or lm-eval that stops importing them
    fails here, and that part of the policy can go)."""
    got = _python(_AFTER)
    assert got["before"] is True and got["forwarded"] is False and got["requests"] is True


def test_an_earlier_import_is_left_as_it_is():
    got = _python("import scipy.optimize\nfrom mpitp import importpolicy\nimportpolicy.start_up()\n" + _AFTER)
    assert got["before"] is True and got["forwarded"] is False and got["called"] == got["real"]


def test_any_other_name_asked_of_the_stand_in_is_the_real_modules():
    """A release that imports more names from the module than :data:`DEFERRED` lists gets the real ones (slower,
    never wrong), and the stand-in leaves ``sys.modules`` as it does."""
    got = _python(
        "import json, sys\n"
        "from mpitp import importpolicy\n"
        "stand_in = importpolicy._StandIn('json', ('dumps',))\n"
        "real = sys.modules.pop('json')\n"
        "sys.modules['json'] = stand_in\n"
        "forwarded = stand_in.dumps([1, 2])\n"
        "loads = stand_in.loads\n"
        "print(real.dumps(dict(forwarded=forwarded, loads=loads('[3]'), same=loads is sys.modules['json'].loads,\n"
        "                      gone=sys.modules['json'] is not stand_in)))\n")
    assert got == {"forwarded": "[1, 2]", "loads": [3], "same": True, "gone": True, "stderr": ""}


_MODELS = (
    "import json, sys\n"
    "import transformers.models, transformers.modeling_utils, lm_eval.utils  # every module the policy covers\n"
    "import transformers.utils.import_utils as iu\n"
    "scan = iu.create_import_structure_from_path\n"
    "print(json.dumps(dict(misses=scan.cache_info().misses, hits=scan.cache_info().hits,\n"
    "                      restored=hasattr(scan, 'cache_info') and scan.__module__ == iu.__name__,\n"
    "                      finders=[type(f).__module__ for f in sys.meta_path],\n"
    "                      top=sorted(sys.modules['transformers']._class_to_module.items()),\n"
    "                      names=sorted(sys.modules['transformers.models']._class_to_module.items()),\n"
    "                      modules=sorted(sys.modules['transformers.models']._modules))))\n")
_POLICY = "from mpitp import importpolicy\nimportpolicy.start_up()\n"


def _kept(cache: Path) -> list[Path]:
    return sorted((cache / "import-scan").glob("*.json"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """A process without the policy: its scans and its tables of names."""
    return _python(_MODELS, MPITP_CACHE=str(tmp_path_factory.mktemp("unused")))


def test_transformers_model_scan_kept_then_read_and_the_tables_the_same(tmp_path, reference):
    """``import transformers`` and ``transformers.models`` each read every model file for their lazy tables. Under
    the policy the first process scans once (half the scans of a process without it) and keeps the scan in this
    user's cache (a private file); the next reads it and scans nothing of the model folders. Both build exactly the
    tables of names a process without the policy builds; afterwards the scanning function is transformers' own
    again and the finder is gone."""
    without = reference
    first = _python(_POLICY + _MODELS, MPITP_CACHE=str(tmp_path))
    kept = _kept(tmp_path)
    assert len(kept) == 1 and kept[0].stat().st_mode & 0o022 == 0
    second = _python(_POLICY + _MODELS, MPITP_CACHE=str(tmp_path))
    assert without["misses"] > 1000 and without["hits"] == 0
    assert first["misses"] * 2 <= without["misses"] + 2, (first["misses"], without["misses"])
    assert second["misses"] <= 5, second["misses"]  # a model package's own folder at most (llama's)
    for got in (first, second):
        assert got["top"] == without["top"] and len(without["top"]) > 1000
        assert got["names"] == without["names"] and got["modules"] == without["modules"]
        assert got["restored"] and "mpitp.importpolicy" not in got["finders"]


@pytest.mark.slow
def test_a_kept_scan_not_believed_is_scanned_again_and_the_tables_the_same(tmp_path, reference):
    """A kept scan for another key (a model edited: the key is the files' stat), one others could have written
    or one that is not a scan: scanned again as without a cache (silently: every rank reads it), the same tables, and
    the file replaced by a private one the next process reads."""
    _python(_POLICY + _MODELS, MPITP_CACHE=str(tmp_path))
    kept = _kept(tmp_path)[0]
    for spoil in ("other key", "group-writable", "not json", "bad shape"):
        data = json.loads(kept.read_text())
        if spoil == "other key":
            data["key"][-1] = "0" * 64
            kept.write_text(json.dumps(data))
        elif spoil == "group-writable":
            kept.chmod(0o664)
        elif spoil == "not json":
            kept.write_text("{")
        else:
            data["scan"][0][0] = "x"
            kept.write_text(json.dumps(data))
        got = _python(_POLICY + _MODELS, MPITP_CACHE=str(tmp_path))
        assert got["misses"] > 500, (spoil, got["misses"])
        assert got["names"] == reference["names"] and got["top"] == reference["top"], spoil
        assert got["stderr"] == "", (spoil, got["stderr"][-500:])
        assert kept.stat().st_mode & 0o022 == 0 and _python(_POLICY + _MODELS, MPITP_CACHE=str(tmp_path))[
            "misses"] <= 5, spoil  # kept again, privately, and read by the next process


def test_the_kept_scan_round_trips_and_its_key_follows_the_files(tmp_path):
    """The JSON form is the scan itself, back (folders, backends, modules, names, order); the key changes when a
    file under the folder is added, edited or removed, or the scanner changes, and not otherwise."""
    import transformers.utils.import_utils as iu

    folder = os.path.join(os.path.dirname(iu.__file__), os.pardir, "models")
    scan = iu.create_import_structure_from_path(os.path.realpath(folder))
    back = importpolicy._decode(json.loads(json.dumps(importpolicy._encode(scan))))
    assert back == scan and list(back) == list(scan)
    for bad in ([["x"]], [["b", ["torch"], [["m", [1]]]]], [["d", "a", "not a list"]], {"d": 1}):
        with pytest.raises(ValueError):
            importpolicy._decode(bad)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "modeling_a.py").write_text("__all__ = ['A']\n")
    scanner = tmp_path / "scanner.py"
    scanner.write_text("")
    key = importpolicy._key(str(tmp_path), str(scanner))
    assert importpolicy._key(str(tmp_path), str(scanner)) == key
    (tmp_path / "m" / "modeling_a.py").write_text("__all__ = ['A', 'B']\n")
    edited = importpolicy._key(str(tmp_path), str(scanner))
    (tmp_path / "m" / "modeling_b.py").write_text("")
    added = importpolicy._key(str(tmp_path), str(scanner))
    (tmp_path / "m" / "modeling_b.py").unlink()
    scanner.write_text("# another transformers\n")
    assert len({tuple(key), tuple(edited), tuple(added), tuple(importpolicy._key(str(tmp_path), str(scanner)))}) == 4
