"""TP traffic per scored token, from mpitp's own counters: tp=2, rolling loglikelihood (wikitext_local).

    python bench/bench_tp_traffic.py [--limit 2] [--reps 2]

Two models side by side, same task and layout: the random-weight Llama with the GPT-2 vocabulary (50257) and the
real stories260K Llama (vocab 512). mpitp's vocab-parallel scoring combines three all-reduces per scored token
(max 4 B + [sum-exp, target logit] 8 B + argmin index 4 B = 16 B) whatever the vocabulary, so the counter
``tp_score_bytes`` (stored in the HDF5 ``/stats`` and printed as "B/scored token in scoring reductions") divided by
``tokens_scored`` must be <= 16 for both vocabularies. ``tp_bytes`` also counts the leader's broadcast of the
packed input ids (int64: one per input position plus two per scored token); transformers' own per-layer TP
all-reduces of the hidden states are not counted by either counter (they are O(hidden), not O(vocab)).

Last lines: ``RATIO tp_all_bytes_per_token <all TP bytes per scored token, GPT-2 vocabulary>`` (the input broadcast
included: what issue 31's regression grew) and ``RATIO tp_traffic_bytes_per_token <the larger of the two
vocabularies' B/scored token in the scoring reductions>``.
"""

from __future__ import annotations

import common


def main() -> None:
    ap = common.parser(__doc__, limit=2, limit_help="wikitext documents")
    args = ap.parse_args()
    models = [("gpt2-vocab llama-h512-l8", common.small_model()), ("stories260K", str(common.STORIES))]
    common.say(common.machine())
    rows, per_tok, all_per_tok = [], {name: [] for name, _ in models}, []
    for rep in range(args.reps):
        for name, path in models:
            r = common.run_mpitp(2, path, "wikitext_local", tp=2, batch_size=1, limit=args.limit,
                                 label=f"mpitp tp=2 {name}")
            st = r["h5_stats"]
            score_b, tok, all_b = st["tp_score_bytes"][0], st["tokens_scored"][0], st["tp_bytes"][0]
            from transformers import AutoConfig

            vocab = AutoConfig.from_pretrained(path).vocab_size
            b = score_b / tok
            per_tok[name].append(b)
            if path != str(common.STORIES):
                all_per_tok.append(all_b / tok)
            rows.append([rep + 1, name, vocab, int(tok), int(st["forwards"][0]), int(score_b), b, all_b / tok,
                         r["mpitp_wall_s"]])
    common.say(common.fmt_table(rows, ["rep", "model", "vocab", "tokens_scored", "forwards", "tp_score_bytes",
                                       "B/tok scoring", "B/tok all TP (incl. input bcast)", "mpitp wall s"]))
    worst = max(max(v) for v in per_tok.values())
    for name, v in per_tok.items():
        common.say(f"{name}: {v[-1]:.2f} B per scored token in scoring reductions")
    ratio = per_tok[models[0][0]][-1] / per_tok[models[1][0]][-1]
    common.say(f"vocab 50257 / vocab 512 bytes-per-token ratio: {ratio:.3f} (1.0 = independent of the vocabulary)")
    common.say(f"target: <= 16 B/token for both: {'MET' if worst <= 16 else 'MISSED'}")
    common.say(common.loadavg())
    # All of the group's TP traffic (input broadcast included) per scored token, GPT-2 vocabulary: the figure issue 31's
    # regression grew while the scoring one below stayed at 16.
    common.say(f"RATIO tp_all_bytes_per_token {all_per_tok[-1]:.2f}")
    common.say(f"RATIO tp_traffic_bytes_per_token {worst:.2f}")


if __name__ == "__main__":
    main()
