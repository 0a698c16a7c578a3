"""Imports put off by the console command (mpitp.importpolicy): transformers' model code imported without scipy's
optimiser, which then comes on its first call, the same function; nothing of the policy left behind. Each case in a
fresh interpreter (the test process has imported transformers already)."""

from __future__ import annotations

import json
import subprocess
import sys


def _python(code: str) -> dict:
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


_AFTER = (
    "import json, sys\n"
    "import transformers.modeling_utils\n"
    "from transformers.loss import loss_for_object_detection as od, loss_utils\n"
    "state = dict(before='scipy.optimize' in sys.modules,\n"
    "             finders=[type(f).__module__ for f in sys.meta_path],\n"
    "             loader=type(loss_utils.__loader__).__module__, spec=type(loss_utils.__spec__.loader).__module__)\n"
    "rows, cols = od.linear_sum_assignment([[4.0, 1.0, 3.0], [2.0, 0.0, 5.0], [3.0, 2.0, 2.0]])\n"
    "import scipy.optimize\n"
    "real = scipy.optimize.linear_sum_assignment([[4.0, 1.0, 3.0], [2.0, 0.0, 5.0], [3.0, 2.0, 2.0]])\n"
    "state.update(called=[rows.tolist(), cols.tolist()], real=[real[0].tolist(), real[1].tolist()],\n"
    "             module=type(scipy.optimize).__name__, forwarded=od.linear_sum_assignment is not\n"
    "             scipy.optimize.linear_sum_assignment)\n"
    "print(json.dumps(state))\n")


def test_transformers_imports_without_scipy_optimize_and_calls_the_real_one():
    got = _python("from mpitp import importpolicy\nimportpolicy.start_up()\n" + _AFTER)
    assert got["before"] is False  # put off: transformers' model code imported, scipy.optimize not
    assert "mpitp.importpolicy" not in got["finders"]  # the finder left once it had covered its module
    assert got["loader"] != "mpitp.importpolicy" and got["spec"] != "mpitp.importpolicy"
    assert got["called"] == got["real"] == [[0, 1, 2], [1, 0, 2]]
    assert got["module"] == "module" and got["forwarded"] is True  # the real module in sys.modules afterwards


def test_without_the_policy_transformers_imports_scipy_optimize():
    """The control: what the policy saves is there to save (a transformers that stops importing it fails here,
    and the policy can go)."""
    got = _python(_AFTER)
    assert got["before"] is True and got["forwarded"] is False


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
    assert got == {"forwarded": "[1, 2]", "loads": [3], "same": True, "gone": True}


_MODELS = (
    "import json, sys\n"
    "import transformers.models, transformers.modeling_utils\n"
    "import transformers.utils.import_utils as iu\n"
    "lazy = sys.modules['transformers.models']\n"
    "scan = iu.create_import_structure_from_path\n"
    "print(json.dumps(dict(misses=scan.cache_info().misses, hits=scan.cache_info().hits,\n"
    "                      restored=hasattr(scan, 'cache_info') and scan.__module__ == iu.__name__,\n"
    "                      finders=[type(f).__module__ for f in sys.meta_path],\n"
    "                      names=sorted(lazy._class_to_module.items()), modules=sorted(lazy._modules))))\n")


def test_transformers_scans_its_model_folders_once_and_builds_the_same_table():
    """``import transformers`` and ``transformers.models`` each read every model file for their lazy tables; under
    the policy the second is the first's (one cache hit, half the misses), the table of names the same as without
    it, the scanning function transformers' own again afterwards and the finder gone."""
    with_policy = _python("from mpitp import importpolicy\nimportpolicy.start_up()\n" + _MODELS)
    without = _python(_MODELS)
    assert without["hits"] == 0 and with_policy["hits"] == 1
    assert with_policy["misses"] * 2 <= without["misses"] + 2, (with_policy["misses"], without["misses"])
    assert with_policy["names"] == without["names"] and len(without["names"]) > 1000
    assert with_policy["modules"] == without["modules"]
    assert with_policy["restored"] and "mpitp.importpolicy" not in with_policy["finders"]
