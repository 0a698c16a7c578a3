"""The lm-eval model: HF semantics from lm-eval's own ``HFLM``, computation sharded across DP groups and TP ranks.

``HFLM`` keeps doing everything that defines lm-eval's numbers (tokenisation and the empty-context prefix rule,
rolling windows, chat templates, stop sequences, left truncation, generation post-processing). This subclass only
replaces *where* that work and the forwards happen: global rank 0 turns each request into a work item, the
dispatcher spreads the items over the DP groups, and inside a group the TP leader drives its workers (see
:mod:`mpitp.replica.leader`).

Tokenising is part of the work item's computation, not rank 0's: a ``loglikelihood`` item is the request's
``(context, continuation)`` text, and the DP leader that scores it encodes it with lm-eval's own
``TemplateLM.loglikelihood`` loop (``_encode_pair``, the empty-context prefix rule), a ``generate_until`` item is
its text as well (``HFLM.generate_until`` encodes it). Rank 0 balances the chunks by characters instead of tokens.
Rolling requests stay tokenised on rank 0: they are dispatched window by window, and the windows come from the
tokens (few, long documents, so this is little of rank 0's time).
"""

from __future__ import annotations

import functools
import hashlib
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lm_eval import utils as lm_utils
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils import normalize_gen_kwargs

if TYPE_CHECKING:
    from lm_eval.api.instance import Instance
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from mpitp.evaluation.phases import PhaseClock
    from mpitp.replica.batchsize import AutoBatch
    from mpitp.replica.leader import ReplicaLeader

KIND_SCORE = "loglikelihood"
KIND_ROLLING = "loglikelihood_rolling"
KIND_GENERATE = "generate_until"
KIND_WINDOW = "rolling_window"
"""One rolling window of a ``loglikelihood_rolling`` request, dispatched on its own: a long document (a wikitext
page is up to tens of windows) would otherwise be one indivisible chunk item and leave the other DP groups idle.
A window item is ``(scoring row, share)``, ``share`` being 1 / the request's window count (for the request counter)."""


def combine_windows(parts: list[tuple[float, bool, int]]) -> tuple[float, bool, int]:
    """A rolling request's result from its windows' ``(ll, greedy, n)``: as lm-eval sums them (``fsum``: exact,
    so the order windows come back in does not matter)."""
    return math.fsum(p[0] for p in parts), all(p[1] for p in parts), sum(p[2] for p in parts)


def shared_context_weights(pairs: list[tuple[str, str]]) -> list[int]:
    """Each request's weight (characters) for the chunking, equal for all requests with the same context: chunks are
    cut from the requests sorted by weight, so a multiple-choice document's choices stay next to each other (and
    mostly in one chunk, where the DP leader scores them as one tree, :mod:`mpitp.replica.prefix`). The sum, which
    the balancing uses, is kept to within rounding."""
    members: dict[str, list[int]] = {}
    for i, (ctx, _) in enumerate(pairs):
        members.setdefault(ctx, []).append(i)
    weights = [0] * len(pairs)
    for ix in members.values():
        w = round(sum(len(pairs[i][0]) + len(pairs[i][1]) for i in ix) / len(ix))
        for i in ix:
            weights[i] = w
    return weights


@dataclass
class _Req:
    """The part of an lm-eval ``Instance`` that ``HFLM.generate_until`` reads."""

    args: tuple


def args_hash(args: tuple) -> str:
    """Stable hash of a request's arguments: part of the resume key (task, doc_id, idx, hash, repeat)."""
    return hashlib.sha1(repr(args).encode("utf-8", "surrogatepass")).hexdigest()[:16]


def request_keys(instances: Sequence[Instance], picked: Mapping[str, Sequence[int]] | None = None) -> list[tuple]:
    """Each request's key ``(task, doc_id, idx, args_hash, repeat)``, in request order.

    ``doc_id`` is the document's index in its task (what ``--samples`` names and a full run stores for it), not
    lm-eval's renumbering of the documents a ``samples`` list kept (``picked``:
    :func:`mpitp.evaluation.picked.picked_docs`); so a ``--samples`` run's rows compare with a full run's, document
    by document.

    A task with ``repeats: k`` (pass@k, self-consistency) hands lm-eval's model the same request k times in a row;
    ``repeat`` (0..k-1, counted in request order, which lm-eval builds the same way in every run) tells the clones
    apart, so each has its own row, its own resume entry and its own sampling seed.
    """
    seen: dict[tuple, int] = {}
    keys = []
    for inst in instances:
        doc = int(inst.doc_id)
        ids = picked.get(inst.task_name) if picked else None
        base = (inst.task_name, ids[doc] if ids else doc, int(inst.idx), args_hash(inst.args))
        rep = seen.get(base, 0)
        seen[base] = rep + 1
        keys.append(base + (rep,))
    return keys


def sample_seed(base: int | list, key: tuple) -> int:
    """The seed of one sampled generation: a function of the run's seed and the request's key only, so a request
    samples the same text whatever DP group, batch or resume computes it."""
    return int(hashlib.sha1(repr((base,) + tuple(key)).encode()).hexdigest()[:8], 16)


def _timed(method):
    """One of lm-eval's request methods, timed by the clock of the run being served (:meth:`MPITPLM.serving`). A
    method of the class, not a wrapper in the instance's dict (which would hold the instance: a cycle)."""

    @functools.wraps(method)
    def timed(self, *args, **kwargs):
        if self.clock is None:
            return method(self, *args, **kwargs)
        with self.clock.timing():
            return method(self, *args, **kwargs)

    return timed


class MPITPLM(HFLM):
    """``HFLM`` whose forwards run on TP-sharded replicas in DP groups. Built on every DP leader."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | str, leader: ReplicaLeader, *,
                 batch_size: int = 1, max_length: int | None = None, auto: AutoBatch | None = None,
                 encode_cache: dict | None = None, seed: int | list | None = None, **hflm_kwargs):
        """``leader``: this DP group's :class:`~mpitp.replica.leader.ReplicaLeader` (it runs the forwards); ``auto``:
        a :class:`~mpitp.replica.batchsize.AutoBatch` with ``--batch_size auto``; ``encode_cache``: token ids a
        sweep shares among checkpoints with the same tokenizer; ``seed``: base of the per-request sampling seeds
        (the runs pass :meth:`~mpitp.evaluation.settings.EvalConfig.sampling_seed`)."""
        super().__init__(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length,
                         **hflm_kwargs)
        self.leader = leader
        # rank 0, while lm-eval runs: a callable (kind, items, weights, keys) -> results (mpitp.evaluation.runner)
        self.serve_requests = None
        self.clock = None  # rank 0, while lm-eval runs: the run's PhaseClock (mpitp.evaluation.phases)
        self.picked: dict[str, tuple[int, ...]] = {}  # rank 0, while lm-eval runs: the run's --samples (picked_docs)
        self.seed = 1234 if seed is None else seed  # lm-eval's default torch seed unless --seed
        self.auto = auto
        if auto is not None:
            self.batch_sizes = auto.chosen  # recorded as lm-eval's batch_sizes
        self.encode_cache = encode_cache

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs) -> list[int]:
        """``HFLM.tok_encode``, memoised when :attr:`encode_cache` is set (:mod:`mpitp.jobs.sweep`): a sweep's
        checkpoints with the same tokenizer tokenise each prompt once."""
        if self.encode_cache is None or kwargs:
            return super().tok_encode(string, add_special_tokens=add_special_tokens,
                                      left_truncate_len=left_truncate_len, **kwargs)
        key = (string, add_special_tokens, left_truncate_len, self.add_bos_token)
        hit = self.encode_cache.get(key)
        if hit is None:
            hit = self.encode_cache[key] = super().tok_encode(string, add_special_tokens=add_special_tokens,
                                                              left_truncate_len=left_truncate_len)
        return list(hit)

    # ------------------------------------------------------------------ rank 0: lm-eval's entry points
    @contextmanager
    def serving(self, serve_requests: Callable[[str, list, list, list[tuple]], list], clock: PhaseClock,
                picked: Mapping[str, tuple[int, ...]] | None = None) -> Iterator[MPITPLM]:
        """While lm-eval runs on rank 0: its requests go to ``serve_requests`` (with their keys,
        :func:`request_keys`, whose document indices ``picked`` maps) and are timed by ``clock``. Both are
        dropped on leaving, whatever happens: ``serve_requests`` leads back to :meth:`compute` (through the
        dispatcher), a cycle that would otherwise keep the model alive after the run (a sweep frees it before
        loading the next checkpoint)."""
        self.serve_requests, self.clock, self.picked = serve_requests, clock, dict(picked or {})
        try:
            yield self
        finally:
            self.serve_requests = self.clock = None
            self.picked = {}

    def check_chat_template(self, setting: bool | str) -> None:
        """Rank 0, before lm-eval builds a request: with ``--apply_chat_template``, lm-eval's own selection of the
        template (a name the tokenizer lacks) and a one-message conversation rendered as lm-eval renders its prompts;
        what transformers refuses (a tokenizer without any chat template) is one line, not a ValueError traceback
        from the middle of lm-eval's request building."""
        if not setting:
            return
        from mpitp.errors import UsageError

        try:
            self.chat_template(setting)
            self.apply_chat_template([{"role": "user", "content": "Hi"}])
        except ValueError as exc:
            why = " ".join(str(exc).split()[:40]) or type(exc).__name__
            raise UsageError(f"--apply_chat_template: the tokenizer cannot apply a chat template: {why}") from None

    @_timed
    def loglikelihood(self, requests: list[Instance], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """Items are the requests' ``(context, continuation)`` texts, weighed by characters; the DP leader that gets
        a chunk tokenises it (:meth:`score_rows_of`)."""
        pairs = [tuple(req.args) for req in requests]
        weights = shared_context_weights(pairs)
        keys = request_keys(requests, self.picked)
        out = self.serve_requests(KIND_SCORE, pairs, weights, keys)
        refuse_nonfinite([ll for ll, _, _ in out], keys)
        answers = [(ll, greedy) for ll, greedy, _ in out]
        for pair, ans in zip(pairs, answers):
            self.cache_hook.add_partial("loglikelihood", pair, ans)
        return answers

    def longest_tokens(self, kind: str, items: list, weights: list, sample: int = 64) -> int:
        """The longest row in tokens (``--batch_size auto`` sizes the chunks' batches for it), from the ``sample``
        items longest in characters: rank 0 tokenises those few, not the whole set."""
        if kind == KIND_ROLLING:
            return max((len(r[0]) for rows in items for r in rows), default=1)
        top = sorted(range(len(items)), key=lambda i: -weights[i])[:sample]
        if kind == KIND_SCORE:
            return max((len(row) for row, _ in self.score_rows_of([items[i] for i in top])), default=1)
        return max((len(self.tok_encode(items[i][0])) + self.new_tokens(items[i][1])
                    for i in top), default=1)  # generate_until: prompt plus the tokens to generate

    def new_tokens(self, gen_kwargs: dict) -> int:
        """The tokens a request may generate, read as lm-eval's HFLM reads them (``max_gen_toks`` or one of its
        aliases, ``max_new_tokens`` ..., else the model's default)."""
        return int(normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)["max_gen_toks"])

    # ------------------------------------------------------------------ a DP leader: lm-eval's encodings
    def score_rows_of(self, pairs: list) -> list[tuple[list[int], int]]:
        """``(context, continuation)`` texts -> scoring rows, encoded by lm-eval's own ``loglikelihood`` loop
        (``_encode_pair``, the empty-context prefix rule), which hands them to :meth:`_loglikelihood_tokens`.

        ``_encode_pair`` encodes each request's context alone besides the whole text, and a multiple-choice document's
        requests share their context (hellaswag: 4 of them): outside a sweep the encodings are memoised for the
        call, so each context is encoded once (the same ``tok_encode``, the same ids)."""
        for_call = self.encode_cache is None
        if for_call:
            self.encode_cache = {}
        try:
            return HFLM.loglikelihood(self, [_Req(tuple(p)) for p in pairs], disable_tqdm=True)
        finally:
            if for_call:
                self.encode_cache = None

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
        """Reached from :meth:`score_rows_of` with lm-eval's encodings, one per request, in request order: the rows
        lm-eval's ``_loglikelihood_tokens`` would score (input plus last target, number of targets)."""
        rows = []
        for _, ctx, cont in requests:
            if not 0 < len(cont) <= self.max_length:  # lm-eval asserts it: a traceback, from a DP leader mid-run
                from mpitp.errors import UsageError

                raise UsageError(f"a request's continuation is {len(cont)} tokens, which lm-eval cannot score with "
                                 f"the model's max_length {self.max_length} (it must be 1 to max_length tokens): pass "
                                 "a larger --max-length if the model allows it")
            assert ctx, "lm-eval's _encode_pair never gives an empty context"
            rows.append(((ctx + cont)[-(self.max_length + 1):], len(cont)))
        return rows

    def rolling_rows(self, string: str) -> list[tuple[list[int], int]]:
        """lm-eval's disjoint rolling windows of ``string`` as scoring rows (same helpers as ``HFLM``)."""
        windows = map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
            token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
            max_seq_len=self.max_length, context_len=1))
        return [((ctx + cont)[-(self.max_length + 1):], len(cont)) for ctx, cont in windows]

    @_timed
    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        items = [self.rolling_rows(req.args[0]) for req in requests]
        weights = [sum(len(r[0]) for r in rows) for rows in items]
        keys = request_keys(requests, self.picked)
        out = self.serve_requests(KIND_ROLLING, items, weights, keys)
        refuse_nonfinite([ll for ll, _, _ in out], keys)
        lls = [ll for ll, _, _ in out]
        for req, ll in zip(requests, lls):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, ll)
        return lls

    @_timed
    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        keys = request_keys(requests, self.picked)
        items = [(*req.args, sample_seed(self.seed, key)) for req, key in zip(requests, keys)]
        # Weighed by characters (~4 per token, a balance proxy only) plus the tokens to generate: the DP leader that
        # gets a request tokenises it (``HFLM.generate_until``), rank 0 does not.
        new = [self.new_tokens(kw) for _, kw, _ in items]
        if new and max(new) >= self.max_length:  # lm-eval asserts it per batch, after the others have started
            from mpitp.errors import UsageError

            raise UsageError(f"max_gen_toks {max(new)} leaves no room for the prompt in the model's max_length "
                             f"{self.max_length} (lm-eval refuses it too): lower max_gen_toks (--gen_kwargs) or pass "
                             "a larger --max-length")
        self._check_generation_kwargs(requests)
        weights = [len(ctx) // 4 + 1 + n for (ctx, _, _), n in zip(items, new)]
        out = self.serve_requests(KIND_GENERATE, items, weights, keys)
        return [text for text, _ in out]

    def _check_generation_kwargs(self, requests: list[Instance]) -> None:
        """Rank 0, before any generation: each distinct set of generation kwargs (a task's, ``--gen_kwargs`` merged)
        checked as lm-eval's HFLM will pass it to ``generate``
        (:func:`~mpitp.evaluation.gen_kwargs_check.check_request_generation`): a bad one is one line here, not a
        ValueError on the DP leader that meets it first."""
        from mpitp.evaluation.gen_kwargs_check import check_request_generation

        seen = set()
        for req in requests:
            kw = req.args[1]
            key = repr(sorted(kw.items(), key=lambda item: str(item[0])))
            if key not in seen:
                seen.add(key)
                check_request_generation(kw, self.max_gen_toks, req.task_name)

    # ------------------------------------------------------------------ every DP leader: compute a chunk
    def compute(self, kind: str, items: list, tick: Callable[[], object] | None = None) -> list:
        """Run one chunk on this DP group. Results: (ll, greedy, n) for scoring, (text, n_tokens) for generation."""
        t0 = time.perf_counter()
        try:
            return self._compute(kind, items, tick)
        finally:
            self.leader.stats.busy_s += time.perf_counter() - t0
            self.leader.stats.requests += math.fsum(s for _, s in items) if kind == KIND_WINDOW else len(items)

    def _compute(self, kind: str, items: list, tick) -> list:
        if kind == KIND_SCORE:
            return self._score_rows(self.score_rows_of(items), tick)
        if kind == KIND_WINDOW:
            return self._score_rows([row for row, _ in items], tick)
        if kind == KIND_GENERATE:
            if self.auto is not None:  # one size for the chunk, from its longest prompt plus the tokens to generate
                longest = max(len(self.tok_encode(item[0])) for item in items)  # items: (context, kwargs, seed)
                new = max(self.new_tokens(item[1]) for item in items)
                self.batch_size_per_gpu = self.auto.size(min(longest, self.max_length), new)
            self._tick = tick
            try:
                texts = self._generate(items)
            finally:
                self._tick = None
            return [(t, len(self.tok_encode(t, add_special_tokens=False))) for t in texts]
        raise ValueError(f"unknown request kind {kind!r}")

    def _generate(self, items: list) -> list[str]:
        """Greedy requests batched as lm-eval batches them; each sampled one alone after seeding torch with its own
        seed (a batch's random draws depend on its other rows: one row per generate makes a request's sample the
        same in every layout, chunking and resume)."""
        import torch

        texts: list = [None] * len(items)
        greedy = [i for i, (_, kw, _) in enumerate(items) if not self._samples(kw)]
        if greedy:
            out = HFLM.generate_until(self, [_Req(tuple(items[i][:2])) for i in greedy], disable_tqdm=True)
            for i, t in zip(greedy, out):
                texts[i] = t
        for i, (ctx, kw, seed) in enumerate(items):
            if texts[i] is None:
                torch.manual_seed(seed)
                texts[i] = HFLM.generate_until(self, [_Req((ctx, kw))], disable_tqdm=True)[0]
        return texts

    def _samples(self, kw: dict) -> bool:
        """Whether lm-eval's HFLM samples for these generation kwargs: its own rule (``normalize_gen_kwargs``, which
        ``HFLM.generate_until`` applies before ``generate``: ``do_sample`` as given, else sampling when the
        temperature is above 0), so the model's generation config never decides. A request with ``temperature: 0.8``
        and no ``do_sample`` samples: it must be seeded alone, or its text would depend on its batch."""
        return bool(normalize_gen_kwargs(kw, self.max_gen_toks)["do_sample"])

    def _score_rows(self, rows: list, tick) -> list:
        """Score rows at the fixed batch size, or with ``--batch_size auto`` bucket by bucket at each one's size."""
        if self.auto is None:
            return self.leader.score_rows(rows, self.batch_size, tick)
        out: list = [None] * len(rows)
        for size, idx in self.auto.groups([len(r[0]) for r in rows]):
            for i, r in zip(idx, self.leader.score_rows([rows[i] for i in idx], size, tick)):
                out[i] = r
        return out

    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        if self.leader.has_workers:  # a task YAML's generation_kwargs get here without passing the checks
            from mpitp.evaluation.checks import refuse_unsupported_generation

            lay = self.leader.layout
            refuse_unsupported_generation(generation_kwargs, getattr(self.model, "generation_config", None),
                                          "generation_kwargs", f"tp={lay.tp} pp={lay.pp}")
        self.leader.nonfinite_steps = 0
        try:
            # the KV cache sized for this call (mpitp.replica.generation.GrowingCache: no copy of it per step), as
            # generate's ``cache`` argument (its older name past_key_values is deprecated)
            reserve = max(0, int(max_length) - int(context.shape[1]))
            greedy = plain_greedy(self.model, generation_kwargs)
            with self.leader.generating(greedy=greedy, reserve=reserve) as kv:
                rows = nullcontext()
                if kv is not None:
                    generation_kwargs = {**generation_kwargs, "cache": kv}
                    if greedy:  # a row that met its stop sequence leaves the decode steps (replica.finished_rows)
                        from mpitp.replica.finished_rows import per_row_stops

                        rows = per_row_stops(self.model, self._text_cut(stop))
                with rows:
                    out = super()._model_generate(context, max_length, stop, **generation_kwargs)
        except RuntimeError as exc:  # torch.multinomial on a NaN/inf distribution (sampling)
            if "inf, nan" not in str(exc):
                raise
            self.leader.nonfinite_steps += 1
        if self.leader.nonfinite_steps:
            from mpitp.errors import UsageError

            start = self.tok_decode(context[0].tolist())[-60:]
            raise UsageError(f"non-finite logits (NaN/inf) while generating for the request whose context ends "
                             f"{start!r}; in float16 this is usually an overflow: try --dtype bfloat16 or float32")
        self.leader.stats.tokens_generated += int((out.shape[1] - context.shape[1]) * out.shape[0])
        if getattr(self, "_tick", None):
            self._tick()
        return out

    def _text_cut(self, stop: list[str]) -> Callable[[list[int]], bool]:
        """Whether lm-eval's text of a row's generated ids is already cut by one of ``stop`` (its
        ``postprocess_generated_text`` of ``tok_decode``, special tokens dropped), so that no later token changes
        it and the row may leave the decode steps (:class:`~mpitp.replica.finished_rows.PerRowStops`). With a
        ``think_end_token`` never: lm-eval keeps the text after the last one, which a later token may still bring."""
        terms = [t for t in stop if t]
        if self.think_end_token is not None or not terms:
            return lambda ids: False

        def cut(ids: list[int]) -> bool:
            text = self.tok_decode(ids)
            return any(t in text for t in terms)

        return cut


def refuse_nonfinite(lls: list[float], keys: Sequence[tuple]) -> None:
    """One line naming the first request (its key, :func:`request_keys`) whose log-likelihood is NaN or infinite
    (rank 0, after scoring)."""
    from mpitp.errors import UsageError

    for (task, doc, idx, *_), ll in zip(keys, lls):
        if not math.isfinite(ll):
            raise UsageError(f"non-finite log-likelihood ({ll}) for task {task}, doc {doc}, request {idx}: the model's "
                             "logits hold NaN/inf; in float16 this is usually an overflow: try --dtype bfloat16 or "
                             "float32")


_GREEDY_SAFE_KWARGS = {"attention_mask", "do_sample", "temperature", "top_p", "top_k"}
_PROCESSOR_DEFAULTS = {"repetition_penalty": (None, 1.0), "no_repeat_ngram_size": (None, 0),
                       "bad_words_ids": (None,), "suppress_tokens": (None,), "begin_suppress_tokens": (None,),
                       "min_length": (None, 0), "min_new_tokens": (None, 0), "forced_bos_token_id": (None,),
                       "forced_eos_token_id": (None,), "sequence_bias": (None,), "encoder_repetition_penalty":
                       (None, 1.0), "num_beams": (None, 1), "penalty_alpha": (None,), "guidance_scale": (None, 1.0),
                       "exponential_decay_length_penalty": (None,)}


def plain_greedy(model: PreTrainedModel, generation_kwargs: dict) -> bool:
    """True when generation is greedy search with no logits processor, so a sharded argmax decides each token.

    Anything that edits logits before the argmax (repetition penalty, suppressed tokens, minimum length, beams)
    needs the real distribution: then transformers' gathered logits are kept.
    """
    if set(generation_kwargs) - _GREEDY_SAFE_KWARGS:
        return False
    gc = getattr(model, "generation_config", None)
    do_sample = generation_kwargs.get("do_sample")
    if do_sample is None:
        do_sample = bool(getattr(gc, "do_sample", False))
    if do_sample:
        return False
    return all(getattr(gc, k, None) in ok for k, ok in _PROCESSOR_DEFAULTS.items()) if gc is not None else True
