"""Real ``lm_eval`` command lines, in lm-eval's documentation style, for the drop-in test (tests/test_lmeval_dropin.py).

Each line is run twice on the same work: as ``lm_eval <line>`` (lm-eval's own CLI code, in-process) and as
``mpiexec -n 2 mpitp eval <line> --tp 2``. Placeholders: ``{model}`` stories260K, ``{chat}`` a copy with a chat
template, ``{tasks}`` the offline task YAMLs, ``{out}`` this line's output folder, ``{config}`` a YAML config file,
``{wandb}`` the line's W&B offline directory, ``{cache}`` its ``--use_cache`` path. mpitp runs each line with
``--tp 2`` or the layout in :data:`LAYOUTS`. A line without ``--output_path`` gets ``--output_path {out}`` on both
sides, so the results can be compared file by file.
"""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

CORPUS: list[tuple[str, str]] = [
    ("basic", "--model hf --model_args pretrained={model} --tasks arc_easy_local --include_path {tasks} --limit 3"),
    ("dtype-two-tasks-samples",
     "--model hf --model_args pretrained={model},dtype=float32 --tasks arc_easy_local,hellaswag_local "
     "--include_path {tasks} --limit 2 --batch_size 4 --output_path {out} --log_samples"),
    ("space-separated", "--model hf --model_args pretrained={model} dtype=float32 --tasks arc_easy_local "
                        "hellaswag_local --num_fewshot 2 --limit 2 --include_path {tasks}"),
    ("rolling-bos", "--model hf --model_args pretrained={model},add_bos_token=True --tasks wikitext_local "
                    "--include_path {tasks} --limit 1 --device cpu"),
    ("rolling-max-length", "--model hf --model_args pretrained={model},max_length=256 --tasks wikitext_local "
                           "--include_path {tasks} --limit 1 --batch_size 2"),
    ("fewshot-gen", "--model hf --model_args pretrained={model} --tasks gsm8k_local --num_fewshot 1 "
                    "--gen_kwargs max_gen_toks=16 --limit 2 --include_path {tasks} --output_path {out} --log_samples"),
    ("gen-kwargs-until", "--model hf --model_args pretrained={model} --tasks gsm8k_local --include_path {tasks} "
                         "--gen_kwargs temperature=0 max_gen_toks=12 'until=[\"\\n\\n\"]' --limit 2 --log_samples "
                         "--output_path {out}"),
    ("chat-template", "--model hf --model_args pretrained={chat} --tasks arc_easy_local --apply_chat_template "
                      "--include_path {tasks} --limit 2 --output_path {out} --log_samples"),
    ("chat-multiturn-fewshot", "--model hf --model_args pretrained={chat} --tasks hellaswag_local --num_fewshot 2 "
                               "--apply_chat_template --fewshot_as_multiturn --include_path {tasks} --limit 2"),
    ("system-instruction", "--model hf --model_args pretrained={chat} --tasks gsm8k_local --apply_chat_template "
                           "--system_instruction 'You are a careful grade-school teacher.' --gen_kwargs "
                           "max_gen_toks=8 --include_path {tasks} --limit 2 --output_path {out} --log_samples"),
    ("system-instruction-plain", "--model hf --model_args pretrained={model} --tasks arc_easy_local "
                                 "--system_instruction 'Answer the question.' --include_path {tasks} --limit 2"),
    ("predict-only", "--model hf --model_args pretrained={model} --tasks arc_easy_local --predict_only "
                     "--include_path {tasks} --limit 2 --output_path {out}"),
    ("samples", "--model hf --model_args pretrained={model} --tasks arc_easy_local "
                "--samples '{{\"arc_easy_local\": [0, 3, 5]}}' --include_path {tasks} --output_path {out} "
                "--log_samples"),
    ("config-file", "--config {config}"),
    ("seeds-fewshot", "--model hf --model_args pretrained={model} --tasks hellaswag_local --num_fewshot 3 "
                      "--seed 1,2,3,4 --include_path {tasks} --limit 2"),
    ("short-flags", "-M hf -a pretrained={model} -t piqa_local -L 2 -f 1 -b 2 --include_path {tasks}"),
    ("tokenizer-prefix", "--model hf --model_args pretrained={model},tokenizer={model},prefix_token_id=1 "
                         "--tasks lambada_openai_local --include_path {tasks} --limit 2"),
    ("metadata-json", "--model hf --model_args pretrained={model} --tasks arc_easy_local "
                      "--metadata '{{\"max_seq_lengths\": [64]}}' --include_path {tasks} --limit 2"),
    ("flags-misc", "--model hf --model_args pretrained={model} --tasks arc_easy_local --trust_remote_code "
                   "--confirm_run_unsafe_code --write_out --show_config --verbosity WARNING --include_path {tasks} "
                   "--limit 2"),
    ("wandb-offline", "--model hf --model_args pretrained={model} --tasks arc_easy_local --include_path {tasks} "
                      "--limit 3 --output_path {out} --log_samples --wandb_args project=mpitp-dropin,mode=offline,"
                      "dir={wandb}"),
    ("auto-batch", "--model hf --model_args pretrained={model} --tasks arc_easy_local,wikitext_local "
                   "--include_path {tasks} --limit 1 --batch_size auto --max_batch_size 8"),
    ("use-cache", "--model hf --model_args pretrained={model} --tasks arc_easy_local --include_path {tasks} "
                  "--limit 2 --use_cache {cache}"),
    ("fraction-limit", "--model hf --model_args '{{\"pretrained\": \"{model}\", \"dtype\": \"float32\"}}' "
                       "--tasks lambada_openai_local --include_path {tasks} --limit 0.001"),
]

LAYOUTS: dict[str, list[str]] = {"dtype-two-tasks-samples": ["--pp", "2"], "fewshot-gen": ["--pp", "2"]}
"""mpitp's layout per line on 2 ranks: ``--tp 2`` unless named here (pipeline stages where it matters: scoring
and generation through stages)."""


def layout(name: str) -> list[str]:
    return LAYOUTS.get(name, ["--tp", "2"])


CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}\n"
                 "{% elif m['role'] == 'user' %}Q: {{ m['content'] }}\n{% else %}A: {{ m['content'] }}\n{% endif %}"
                 "{% endfor %}{% if add_generation_prompt %}A:{% endif %}")


def chat_model(model: Path, dest: Path) -> Path:
    """A copy of ``model`` whose tokenizer has a chat template (stories260K has none)."""
    if not dest.exists():
        shutil.copytree(model, dest)
        for f in dest.iterdir():
            f.chmod(0o644)
        cfg_path = dest / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["chat_template"] = CHAT_TEMPLATE
        cfg_path.write_text(json.dumps(cfg, indent=2))
    return dest


def config_file(model: Path, tasks: str, dest: Path) -> Path:
    """An lm-eval ``--config`` YAML (its EvaluatorConfig fields)."""
    dest.write_text(f"model: hf\nmodel_args:\n  pretrained: {model}\n  dtype: float32\ntasks:\n  - hellaswag_local\n"
                    f"include_path: {tasks}\nlimit: 2\nnum_fewshot: 1\nlog_samples: true\n"
                    "output_path: {out}\n")
    return dest


def command_lines(model: Path, tasks: str, work: Path, side: str) -> list[tuple[str, list[str]]]:
    """``(name, argv)`` for every corpus line, outputs under ``work/<side>/<name>``."""
    chat = chat_model(model, work / "stories260K-chat")
    lines = []
    for name, line in CORPUS:
        out = work / side / name
        config = work / side / f"{name}.yaml"
        config.parent.mkdir(parents=True, exist_ok=True)
        text = config_file(model, tasks, config).read_text().replace("{out}", str(out))
        config.write_text(text)
        wandb = work / side / f"{name}-wandb"
        wandb.mkdir(parents=True, exist_ok=True)
        argv = shlex.split(line.format(model=model, chat=chat, tasks=tasks, out=out, config=config, wandb=wandb,
                                       cache=work / side / f"{name}-cache"))
        if "--output_path" not in argv and name != "config-file":
            argv += ["--output_path", str(out)]
        lines.append((name, argv))
    return lines
