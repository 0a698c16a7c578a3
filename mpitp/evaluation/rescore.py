"""``mpitp rescore FILE.h5``: lm-eval's metrics recomputed from the stored per-request results, no model loaded.

After a filter or metric change in a task's YAML, lm-eval's own pipeline runs again (tasks built from the same
settings, the same seeds, ``simple_evaluate``) with an lm that answers every request from the file. A request is
found by the resume key (task, doc_id, idx, hash of its arguments: :func:`mpitp.evaluation.lm.request_keys`), so a
change that
alters the requests themselves (prompt template, few-shot, limit) finds requests missing and is refused, one line,
exit 2: rerun those with ``mpitp eval --resume``.

A results file is data, shared between people; a task folder is code (lm-eval imports the Python a YAML's
``!function`` names). So the task folders (``--include-path``) and the offline data (``--data-dir``) come from the user
only, never from the file: a file that recorded them is refused, one line naming them, until the user passes them.

Without ``--output``/``--in-place`` it prints the new table and how the metrics moved; ``--output NEW.h5`` writes a
copy of the file with the new metrics, per-document scores and lm-eval results; ``--in-place`` replaces the file
(atomically: a temporary, then ``os.replace``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import TYPE_CHECKING

from mpitp.errors import UsageError
from mpitp.results.untrusted import BadInput, load_json, mapping, open_regular, shown

if TYPE_CHECKING:
    from lm_eval.api.instance import Instance
    from lm_eval.api.model import LM

    from mpitp.results.docscores import DocScores

log = logging.getLogger("mpitp")


class MissingRequests(Exception):
    def __init__(self, kind: str, missing: list[tuple], total: int):
        super().__init__(f"{len(missing)} of {total} {kind} requests")
        self.kind, self.missing, self.total = kind, missing, total


def stored_lm(rows: dict[tuple, dict], picked: dict[str, tuple[int, ...]] | None = None) -> LM:
    """An lm-eval model whose every answer is a stored row (``picked``: the run's ``--samples`` documents, as
    :func:`mpitp.evaluation.picked.picked_docs` gives them); a request not in the file stops the run.

    Built by a function so that importing this module (``mpitp --help``) does not import lm-eval.
    """
    from lm_eval.api.model import LM

    from mpitp.evaluation.lm import request_keys

    class StoredLM(LM):
        def __init__(self):
            super().__init__()
            self.served = 0

        def _rows(self, kind: str, requests) -> list[dict]:
            keys = request_keys(requests, picked)
            found = [rows.get(k) for k in keys]
            missing = [k for k, r in zip(keys, found) if r is None or r["kind"] != kind]
            if missing:
                raise MissingRequests(kind, missing, len(keys))
            self.served += len(found)
            return found

        def loglikelihood(self, requests: list[Instance], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
            return [(float(r["loglikelihood"]), bool(r["is_greedy"])) for r in self._rows("loglikelihood", requests)]

        def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
            return [float(r["loglikelihood"]) for r in self._rows("loglikelihood_rolling", requests)]

        def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
            return [str(r["generation"]) for r in self._rows("generate_until", requests)]

    return StoredLM()


def _stored_rows(path: str) -> dict[tuple, dict]:
    """Every stored request row by its resume key; a damaged or crafted file is a one-line usage error."""
    from mpitp.results.rows import load_rows, read_requests
    from mpitp.results.schema import REQUEST_FIELDS

    try:  # the journal's tasks too: a killed run's rows may all be there ("no request rows stored", said of 24)
        tasks = list(load_rows(path, counts_only=True)[1])
        out = {}
        for task in tasks:
            cols = read_requests(path, task)
            for i in range(len(cols["doc_id"])):
                row = {k: cols[k][i] for k in REQUEST_FIELDS}
                out[(task, int(row["doc_id"]), int(row["idx"]), str(row["args_hash"]), int(row["repeat"]))] = row
    except (OSError, KeyError, ValueError, TypeError, RuntimeError) as exc:  # BadInput included
        raise UsageError(f"cannot rescore {path}: {shown(' '.join(str(exc).split())[:300])}", collective=True) \
            from None
    return out


_JSON_TYPES = {"bool": (bool,), "int": (int,), "float": (int, float), "str": (str,), "dict": (dict,),
               "list": (list,), "None": (type(None),), "Any": (object,)}


def saved_settings(text: object) -> dict:
    """A file's recorded settings (``eval_config_json``), each of the type its :class:`EvalConfig` field declares:
    the file is untrusted, and a list where a string belongs would otherwise fail deep inside lm-eval."""
    from dataclasses import fields

    from mpitp.evaluation.settings import EvalConfig

    if not isinstance(text, str):
        raise BadInput(f"a {type(text).__name__}, not JSON text")
    saved = mapping(load_json(text, "the recorded settings"), "the recorded settings")
    types = {f.name: str(f.type) for f in fields(EvalConfig)}
    for k, v in saved.items():
        if k not in types:
            continue
        allowed = tuple(t for part in types[k].split("|") for t in _JSON_TYPES.get(part.strip().split("[")[0], ()))
        if not allowed or (isinstance(v, bool) and bool not in allowed and object not in allowed) \
                or not isinstance(v, allowed):
            raise BadInput(f"{shown(k)} is a {type(v).__name__}, not {types[k]}")
    return saved


def _config(path: str, include_path, data_dir):
    from mpitp.evaluation.settings import EvalConfig
    from mpitp.results.schema import open_h5

    try:
        with open_h5(path) as f:
            attrs = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in f.attrs.items()}
    except BadInput as exc:
        raise UsageError(f"cannot rescore {exc}", collective=True) from None
    except (OSError, RuntimeError) as exc:
        raise UsageError(f"cannot rescore {path}: not an HDF5 file ({str(exc).splitlines()[0]})",
                         collective=True) from None
    if "config_json" not in attrs:
        raise UsageError(f"cannot rescore {path}: not an mpitp results file (no config_json)", collective=True)
    try:
        cfg = EvalConfig.from_saved(saved_settings(attrs.get("eval_config_json") or attrs["config_json"]))
    except ValueError as exc:
        raise UsageError(f"cannot rescore {path}: its recorded settings are not valid ({shown(exc)})",
                         collective=True) from None
    unasked = [f"{flag} {_shown(value)}" for flag, value, given in (
        ("--include-path", cfg.include_path, include_path), ("--data-dir", cfg.data_dir, data_dir))
        if value and not given]
    if unasked:
        raise UsageError(f"cannot rescore {path}: the file names the task folders or data its run used "
                         f"({'; '.join(unasked)}); task folders are code (a YAML's !function imports their Python), "
                         f"so rescore takes them only from you: pass {' and '.join(unasked)} (or other folders)",
                         collective=True)
    cfg.include_path, cfg.data_dir = include_path or None, data_dir or None  # only what the user passed
    if cfg.apply_chat_template:
        raise UsageError(f"cannot rescore {path}: it was made with --apply-chat-template, which needs the "
                         "tokenizer's chat template to rebuild the requests (not supported yet)", collective=True)
    return cfg, attrs


def _shown(value) -> str:
    """A recorded path (or list of them) as the user would pass it back, quoted where a shell needs it."""
    import shlex

    return ",".join(shlex.quote(str(v)) for v in ([value] if isinstance(value, str) else value))


def rescore(path: str, include_path: str | list[str] | None = None, data_dir: str | None = None,
            bootstrap_iters: int | None = None) -> tuple[dict, dict[str, DocScores], int, int]:
    """lm-eval's results dict and the per-document scores for ``path``, from its stored rows only."""
    import lm_eval

    from mpitp.evaluation.checks import check_tasks, offline_include, remove_generated
    from mpitp.evaluation.envinfo import EnvInfoEarly
    from mpitp.evaluation.picked import picked_docs
    from mpitp.results.docscores import capture

    if not os.path.exists(path):  # anything else there but a regular file is refused by the reading (open_h5)
        raise UsageError(f"cannot rescore {path}: no such file", collective=True)
    cfg, attrs = _config(path, include_path, data_dir)
    rows = _stored_rows(path)
    if not rows:
        raise UsageError(f"cannot rescore {path}: no request rows stored", collective=True)
    include = offline_include(cfg)
    try:
        tm = check_tasks(cfg.tasks, include)
        seeds = cfg.seeds()
        picked = picked_docs(cfg.samples)
        lm = stored_lm(rows, picked)
        # EnvInfoEarly: lm-eval's environment record ran torch's collect_env (``python -mpip list``) in this working
        # directory, where a planted pip.py ran as the user, and read its .git by hand
        with EnvInfoEarly(), capture(picked) as doc_scores:
            try:
                res = lm_eval.simple_evaluate(
                    model=lm, tasks=cfg.tasks, num_fewshot=cfg.num_fewshot, limit=cfg.limit,
                    gen_kwargs=cfg.gen_kwargs, log_samples=cfg.log_samples,
                    samples=None if cfg.samples is None else picked,
                    system_instruction=cfg.system_instruction, fewshot_as_multiturn=cfg.fewshot_as_multiturn,
                    predict_only=cfg.predict_only, metadata=cfg.metadata,
                    bootstrap_iters=cfg.bootstrap_iters if bootstrap_iters is None else bootstrap_iters,
                    task_manager=tm, **seeds)
            except MissingRequests as exc:
                task, doc, idx = exc.missing[0][:3]
                raise UsageError(
                    f"cannot rescore {path}: {len(exc.missing)} of {exc.total} {exc.kind} requests are not in the "
                    f"file (first: task {task} doc_id {doc} idx {idx}): the requests changed (prompt, few-shot, "
                    f"limit or file incomplete); recompute them with mpitp eval --resume", collective=True) from None
    finally:
        remove_generated(include)
    return with_run_identity(res, attrs.get("results_json")), doc_scores, lm.served, len(rows)


#: lm-eval's ``config`` keys that name the model and how it ran: the stand-in LM's are not the run's
MODEL_KEYS = ("model", "model_args", "model_num_parameters", "model_dtype", "model_revision", "model_sha",
              "batch_size", "batch_sizes", "device", "use_cache")


def with_run_identity(res: dict, stored: object) -> dict:
    """``res`` with the model of the file's run (its ``results_json``): lm-eval saw the stand-in LM, so its config
    said model 'StoredLM', model_args and device None, and each task's metadata lost the model's arguments (pretrained,
    dtype) lm-eval puts there; a rescored file's ``inspect --json`` no longer said which model it scored. What the
    file holds is untrusted: only mappings are taken, anything else leaves lm-eval's values."""
    try:
        old = mapping(load_json(stored, "results_json"), "results_json") if stored is not None else {}
    except BadInput:
        return res
    cfg, configs = old.get("config"), old.get("configs")
    if isinstance(cfg, dict) and isinstance(res.get("config"), dict):
        res["config"].update({k: cfg[k] for k in MODEL_KEYS if k in cfg})
    for task, c in (res.get("configs") or {}).items():
        oc = configs.get(task) if isinstance(configs, dict) else None
        if isinstance(c, dict) and isinstance(oc, dict) and isinstance(oc.get("metadata"), dict) \
                and isinstance(c.get("metadata"), dict):
            c["metadata"] = {**oc["metadata"], **c["metadata"]}
    return res


def write_rescored(src: str, dst: str, res: dict, doc_scores: dict) -> None:
    """Copy ``src`` to ``dst`` (atomically) with the new metrics, per-document scores, samples and results."""
    import numpy as np

    from mpitp.results.docscores import write as write_scores
    from mpitp.results.safefile import fsync_dir, new_mode, temp_beside
    from mpitp.results.schema import STR, h5_attr, open_h5

    mode = new_mode(dst)  # in place: the file's own mode (a chmod 600 survives); a new --output: the umask's
    fd, tmp = temp_beside(dst, 0o600)  # a new random name, never a link planted in a shared directory
    try:
        with os.fdopen(open_regular(src), "rb") as inp, os.fdopen(os.dup(fd), "wb") as out:  # never a FIFO's wait
            shutil.copyfileobj(inp, out)
        with open_h5(tmp, "r+") as f:
            if os.fstat(f.id.get_vfd_handle()).st_ino != os.fstat(fd).st_ino:
                raise UsageError(f"cannot write {dst}: its temporary {tmp} was replaced while being written")
            for task, cfgd in res.get("configs", {}).items():
                g = f.require_group(f"tasks/{task}")
                n = res.get("n-samples", {}).get(task, {})
                g.attrs["output_type"] = h5_attr(cfgd.get("output_type"))
                g.attrs["num_fewshot"] = h5_attr(res.get("n-shot", {}).get(task, 0))
                g.attrs["n_docs"] = h5_attr(n.get("effective", n.get("original", 0)))
                for name in ("metrics", "doc_scores", "samples"):
                    if name in g:
                        del g[name]
                m = g.create_group("metrics")
                for k, v in res["results"].get(task, {}).items():
                    if k != "alias":
                        m.attrs[k] = h5_attr(v)
                if task in doc_scores:
                    write_scores(g, doc_scores[task])
                samples = res.get("samples", {}).get(task)
                if samples is not None:
                    g.create_dataset("samples", data=np.asarray([json.dumps(s, default=str) for s in samples],
                                                                dtype=object), dtype=STR)
            keep = {k: res[k] for k in ("results", "configs", "versions", "n-shot", "higher_is_better",
                                        "n-samples", "config", "groups", "group_subtasks") if k in res}
            f.attrs["results_json"] = json.dumps(keep, default=str)
            f.attrs["status"] = "complete"
            f.attrs["rescored_from"] = os.path.abspath(src)
        os.fsync(fd)
        os.fchmod(fd, mode)
        os.replace(tmp, dst)
    except BaseException:
        if os.path.lexists(tmp):
            os.remove(tmp)
        raise
    finally:
        os.close(fd)
    fsync_dir(dst)


def metric_changes(path: str, res: dict) -> list[str]:
    """``task metric: old -> new`` for every metric whose value moved (or appeared)."""
    from mpitp.results.schema import open_h5, py_value

    out = []
    with open_h5(path) as f:
        for task, metrics in res.get("results", {}).items():
            old = dict(f[f"tasks/{task}/metrics"].attrs) if f"tasks/{task}/metrics" in f else {}
            for k, v in metrics.items():
                if k == "alias":
                    continue
                o = py_value(old.get(k), "replace")  # an array there (a file is untrusted) as a list: comparable
                v = v.item() if hasattr(v, "item") else v
                if o is None or (o != v and not (isinstance(o, float) and isinstance(v, float) and o == v)):
                    out.append(f"{task} {k}: {o!r} -> {v!r}")
    return out
