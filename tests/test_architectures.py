"""The architecture matrix: causal-LM types of the installed transformers' registry (a subset by rule, or all that
build small), each at tp=1 dp=2, tp=2 and pp=2 (two ranks), compared request by request with single-process lm-eval
(``--model hf``): parity, or mpitp's one-line refusal before scoring. Never a traceback, never a wrong number.

The types are enumerated from transformers' registry (``tests/support/arch.py``), not a hand list; those that are not
plain text decoders or cannot be built small are printed with the reason. One MPI launch per layout runs every model
(a job file with one run each: ~1-3 s a run), and lm-eval's references share their task builds
(:class:`support.arch.References`). ``bench/arch_matrix.py`` runs the same matrix and writes the support table
(docs/model-support.md).

By default a subset runs (:func:`support.arch.suite_subset`: one type per distinct head code, the families of
mpitp's own TP plans, every type the whole-registry run once found failing or this file expects refused, and every
type the support table, docs/model-support.md, does not list yet: a new transformers' new types);
``MPITP_MATRIX_FULL=1`` runs the whole registry (13 minutes on the 2-core VM, about a fifth of CI's suite; the
support table is generated from such a run).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from support import arch as A
from support.mpi import explain, run_mpi

# Refusals of a type that has a plan for the layout, found by running the matrix: what mpitp refuses and why (the
# line's distinctive part). Any other refusal of a type with a plan fails the test (a regression), and so does a type
# without a plan that is not refused.
EXPECTED_REFUSALS = {
    ("doge", "tp2"): "transformers' tensor-parallel plan fails",
    ("inkling_text", "tp2"): "transformers' tensor-parallel plan fails",
    # transformers 5.25's plans for these split only embed_tokens (GPT-OSS spreads its experts with --ep instead)
    **{(t, "tp2"): "reaches none of its layers" for t in ("gpt_oss", "lfm2", "lfm3", "diffllama", "hunyuan_v1_dense")},
    ("codegen", "pp2"): "pipeline split reads the decoder's 'layers'",  # its layer list is 'h'
    ("gptj", "pp2"): "pipeline split reads the decoder's 'layers'",
    ("sarvam_moe", "tp2"): "is split into q_proj, k_proj, v_proj after each rank's shard is cut",
    ("param2moe", "tp2"): "is split into q_proj, k_proj, v_proj after each rank's shard is cut",  # transformers 5.25
    ("hrm_text", "pp2"): "pipeline plan does not place",
    ("hy_v4", "pp2"): "pipeline plan does not place",  # hc_head
    ("deepseek_v4", "pp2"): "pipeline plan does not place",
    ("hrm_text", "tp2"): "transformers' tensor-parallel plan fails",  # wrong by 0.07 before it was refused
    ("minimax", "pp2"): "no attention layer",  # two tiny layers, the second a linear-attention one
    ("olmo_hybrid", "pp2"): "no attention layer",  # two tiny layers: stage 0 holds only a linear-attention one
}


@dataclass
class Registry:
    """The matrix's inputs: every registered type, why some are not in it, the built models and their references."""

    archs: list[A.Arch]
    excluded: dict[str, str] = field(default_factory=dict)  # not a plain text decoder
    unbuilt: dict[str, str] = field(default_factory=dict)  # cannot be built small, or lm-eval cannot score it
    models: dict[str, Path] = field(default_factory=dict)
    refs: dict[str, dict] = field(default_factory=dict)

    def arch(self, name: str) -> A.Arch:
        return next(a for a in self.archs if a.model_type == name)


@pytest.fixture(scope="module")
def registry(tmp_path_factory, test_tasks) -> Registry:
    import torch

    torch.set_num_threads(2)
    root = tmp_path_factory.mktemp("archs")
    reg = Registry(A.architectures())
    also = {name for name, _ in EXPECTED_REFUSALS}
    chosen = None if os.environ.get("MPITP_MATRIX_FULL") else {a.model_type for a in A.suite_subset(reg.archs, also)}
    for arch in reg.archs:
        why = A.not_plain_decoder(arch)
        if why:
            reg.excluded[arch.model_type] = why
            continue
        if chosen is not None and arch.model_type not in chosen:
            reg.unbuilt[arch.model_type] = "not in the test subset (MPITP_MATRIX_FULL=1 runs every type)"
            continue
        try:
            A.build(arch, root / arch.model_type)
            reg.models[arch.model_type] = root / arch.model_type
        except Exception as exc:  # noqa: BLE001 - listed with its reason, never skipped silently
            reg.unbuilt[arch.model_type] = A.first_line(exc)
    references = A.References(test_tasks)
    for name, d in list(reg.models.items()):
        try:
            reg.refs[name] = references(d)
        except Exception as exc:  # noqa: BLE001 - lm-eval cannot score it: nothing to compare with
            reg.unbuilt[name] = f"lm-eval hf cannot score it: {A.first_line(exc)}"
            del reg.models[name]
    return reg


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_registry_is_enumerated_and_reasons_listed(registry, test_tasks):
    """Every registered causal-LM type is in the matrix or listed with its reason; the types that need a step of
    their own around the head (Cohere's scale, Granite's division), GPT-2 and the families of mpitp's own TP plans are
    built; :class:`support.arch.References` gives lm-eval's own ``simple_evaluate`` results."""
    reg = registry
    assert len(reg.archs) == len(reg.excluded) + len(reg.unbuilt) + len(reg.models)
    assert all(reg.excluded.values()) and all(reg.unbuilt.values())
    assert {"llama", "cohere", "granite", "gpt2", "opt", "stablelm", "bloom", "gpt_bigcode"} <= \
        set(reg.models), reg.unbuilt
    print(f"{len(reg.archs)} types: {len(reg.models)} built, {len(reg.excluded)} not plain decoders, "
          f"{len(reg.unbuilt)} not buildable small")
    for name, why in {**reg.excluded, **reg.unbuilt}.items():
        print(f"  {name}: {why}")
    A.dump(os.environ.get("MPITP_MATRIX_DUMP"), "registry", {"excluded": reg.excluded, "unbuilt": reg.unbuilt})
    assert A.reference(reg.models["llama"], test_tasks) == reg.refs["llama"]


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(2400)  # the first one builds the models and runs lm-eval's references
@pytest.mark.parametrize("layout", A.LAYOUTS, ids=[lay.key for lay in A.LAYOUTS])
def test_matrix_layout_matches_lm_eval(layout, registry, test_tasks, tmp_path):
    """One launch runs every built type at this layout: each matches lm-eval request by request, or is refused in
    one line; a type without a plan for the layout is refused, one with a plan is refused only as
    :data:`EXPECTED_REFUSALS` says; no traceback."""
    reg = registry
    job = A.job_file(tmp_path / "matrix.yaml", reg.models, test_tasks, tmp_path, layout.tp, layout.pp)
    proc = run_mpi(layout.ranks, ["run", str(job)], timeout=2000, env=layout.env())
    output = proc.stdout + proc.stderr
    cells = A.outcomes(reg.models, reg.refs, layout, output, tmp_path)
    failures = [f"{name}: {o.cell()}" for name, o in cells.items() if not o.ok]
    for name, o in cells.items():
        planned = A.plan_sources(reg.arch(name))[layout.key] != "none"
        expected = EXPECTED_REFUSALS.get((name, layout.key))
        if o.kind == "refused" and planned and not (expected and expected in o.detail):
            failures.append(f"{name}: refused though it has a plan for {layout.key}: {o.detail}")
        if o.kind == "parity" and not planned:
            failures.append(f"{name}: ran at {layout.key} without a plan for it (expected a refusal)")
        if o.kind == "parity" and expected:
            failures.append(f"{name}: expected refused ({expected}) but now at parity: update EXPECTED_REFUSALS")
    counts = {k: sum(1 for o in cells.values() if o.kind == k) for k in ("parity", "refused")}
    print(f"{layout.key}: {len(cells)} types in one launch, {proc.elapsed:.0f} s: {counts['parity']} parity, "
          f"{counts['refused']} refused, {len(cells) - sum(counts.values())} failed")
    for name, o in cells.items():
        print(f"  {name:22s} {o.cell()[:140]}")
    A.dump(os.environ.get("MPITP_MATRIX_DUMP"), layout.key, {n: vars(o) for n, o in cells.items()})
    assert A.TRACEBACK not in output, explain(proc)
    assert not failures, "\n".join(failures) + "\n" + explain(proc)


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory, test_tasks):
    """Two of the MoE shapes (:data:`support.arch.MOE_SHAPES`: Mixtral's plain top-k router and GPT-OSS's biased
    experts), built tiny, with lm-eval's reference for each (all four held once at issue 40's close, in its note;
    memory and traffic of all four: ``bench/bench_ep.py``)."""
    import torch
    from lm_eval.tasks import TaskManager

    torch.set_num_threads(2)
    root = tmp_path_factory.mktemp("moe")
    archs = {a.model_type: a for a in A.architectures()}
    built = {}
    for name in ("mixtral", "gpt_oss"):
        A.build(archs[name], root / name)
        built[name] = root / name
    tm = TaskManager(include_path=test_tasks)
    return built, {name: A.reference(d, test_tasks, tm) for name, d in built.items()}


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(1800)
def test_experts_spread_over_ranks_match_lm_eval(moe_models, test_tasks, tmp_path):
    """``--ep 2`` at tp=2 (transformers' expert-parallel plan: each rank holds half of every layer's experts, whole,
    and the group sums their outputs) on Mixtral- and GPT-OSS-shaped models, one launch: each matches lm-eval request
    by request. A type without an expert-parallel plan is refused before loading."""
    from support.mpi import run_mpi as launch

    models, refs = moe_models
    job = A.job_file(tmp_path / "ep.yaml", {**models, "llama-no-ep-plan": _llama(tmp_path)}, test_tasks, tmp_path,
                     tp=2, pp=1, ep=2)
    proc = launch(2, ["run", str(job)], timeout=1500)
    failures = []
    for name in models:
        out = tmp_path / f"{name}.h5"
        if not out.exists():
            failures.append(f"{name}: no output")
            continue
        worst, problems = A.compare(refs[name], out)
        print(f"  {name:12s} tp=2 ep=2 max rel |d ll| {worst:.1e}")
        failures += [f"{name}: {p}" for p in problems[:5]]
    assert "model type 'llama' has no expert-parallel plan in transformers; run it without --ep" in proc.stderr + \
        proc.stdout, explain(proc)
    assert not (tmp_path / "llama-no-ep-plan.h5").exists()
    assert not failures, "\n".join(failures) + "\n" + explain(proc)


def _llama(tmp_path):
    """A dense model (no experts) for the refusal: built tiny, never loaded."""
    archs = {a.model_type: a for a in A.architectures()}
    A.build(archs["llama"], tmp_path / "llama")
    return tmp_path / "llama"
