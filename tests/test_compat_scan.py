"""Every reach into a library's private surface goes through :mod:`mpitp.compat` (syntax only: no MPI, no model).

:mod:`support.reach` scans mpitp's modules for private attributes and modules of lm-eval, transformers, torch,
click, peft, h5py and datasets (and private names mpitp never defines, whatever object they are on), for
``inspect.getsource``, and for ``setattr``/``delattr``/``del``/assignments that patch a library's objects. Outside
``mpitp/compat.py`` each one must be either an ``override`` compat declares (a private method an mpitp subclass
overrides or calls through ``super()``: it cannot sit anywhere but in the subclass) or one of :data:`ALLOWED`, each
with its reason. Anything new fails here, naming the line, until it is moved into compat (a target with its
versions, checked at start-up; a patch undone after use) or argued into :data:`ALLOWED`.
"""

from __future__ import annotations

import textwrap

from mpitp import compat
from support.reach import scan

#: (module, name) -> why it stays outside compat. ``setattr (a name)`` is a ``setattr`` whose name is computed.
ALLOWED: dict[tuple[str, str], str] = {
    ("mpitp.errors", "excepthook"): "sys.excepthook is Python's documented hook, set once for the life of an mpitp "
                                    "process: an uncaught exception on any rank aborts the whole MPI job",
    ("mpitp.evaluation.lmeval_args", "setattr (a name)"): "fields of mpitp's own EvalConfig (named by the settings "
                                                          "declarations), not a library object",
    ("mpitp.replica.pipeline", "setattr (a name)"): "the public multipliers a stage's forward applies to its input "
                                                    "(found through compat.forward_tree) set to 1 on mpitp's own "
                                                    "stage model, for good: a stage model is never handed back",
    ("mpitp.replica.tp_fixups", "setattr (a name)"): "head counts, per-head module lists, the rank's rows of a "
                                                     "parameter and a method summed over the group, of mpitp's own "
                                                     "model after mpitp's TP split (public attributes and methods its "
                                                     "plan declares)",
}


def _declared_override(reach) -> bool:
    return any(t.kind == "override" and t.attribute.rpartition(".")[2] == reach.name and reach.module in t.users
               for t in compat.TARGETS.values())


def test_every_private_reach_goes_through_compat():
    stray = [str(r) for r in scan() if not (r.kind == "override" and _declared_override(r))
             and (r.module, r.name) not in ALLOWED]
    assert stray == [], "private reaches outside mpitp.compat (move them there, or say why in ALLOWED):\n" + \
        "\n".join(stray)


def test_every_allowed_entry_is_still_needed():
    """The allow-list only shrinks: an entry whose reach is gone fails until it is deleted."""
    found = {(r.module, r.name) for r in scan()}
    assert set(ALLOWED) <= found, set(ALLOWED) - found


def test_pending_library_reads_are_declared_in_the_table():
    """What is left outside compat for now is still named in its table and checked at start-up."""
    for (module, name), why in ALLOWED.items():
        if why.startswith("pending"):
            assert any(module in t.users and (name in t.names or t.attribute.endswith(name))
                       for t in compat.TARGETS.values()), (module, name)


def test_every_user_in_the_table_uses_compat():
    """The table's "used by" column names modules that reach the target through compat (an override: that define
    the method)."""
    from support.imports import modules

    mods = modules()
    for t in compat.TARGETS.values():
        assert t.kind in compat.KINDS, t.name
        for user in t.users:
            assert user in mods, (t.name, user)
            with open(mods[user], encoding="utf-8") as f:
                text = f.read()
            mark = f"def {t.attribute.rpartition('.')[2]}(" if t.kind == "override" else "compat"
            assert mark in text, (t.name, user, mark)


def test_the_table_lists_every_target():
    rows = compat.table()
    assert len(rows) == len(compat.TARGETS) and all(len(r) == 4 and all(r) for r in rows)
    text = compat.format_table()
    for t in compat.TARGETS.values():
        assert t.name in text, t.name


def test_the_scan_finds_each_kind_of_reach(tmp_path):
    """The scan itself: a package holding one of each reach finds them all (and nothing in code that has none)."""
    pkg = tmp_path / "sample"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "bad.py").write_text(textwrap.dedent("""
        import inspect
        import socket

        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks._index import Kind


        def reaches(tm, model, ctx, task, name, value, f):
            tm._index = {}
            model._pp_forward_wrapped = False
            del model.forward
            setattr(model, name, value)
            ctx._protected_args = []
            socket.socket.connect = f
            inspect.getsource(f)
            return getattr(task, "_metric_fn_list", None), Kind


        class LM(HFLM):
            def _model_generate(self, context):
                return super()._model_generate(context)
    """))
    (pkg / "good.py").write_text(textwrap.dedent("""
        class Own:
            def __init__(self):
                self._cache = {}

            def _helper(self, other):
                setattr(self, "x", 1)
                return other._cache, self._helper
    """))
    found = {(r.module.rpartition(".")[2], r.kind, r.name) for r in scan(str(pkg))}
    expected = {("bad", "patch", "_index"), ("bad", "patch", "_pp_forward_wrapped"), ("bad", "patch", "forward"),
                ("bad", "patch", "setattr (a name)"), ("bad", "patch", "_protected_args"), ("bad", "patch", "connect"),
                ("bad", "source", "inspect.getsource"), ("bad", "private", "_metric_fn_list"),
                ("bad", "private", "lm_eval.tasks._index.Kind"), ("bad", "override", "_model_generate")}
    assert expected <= found, expected - found
    assert not {f for f in found if f[0] == "good"}, found
