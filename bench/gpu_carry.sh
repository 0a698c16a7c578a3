#!/usr/bin/env bash
# Run bench/gpu_drill.py on a GPU machine that has a CUDA torch but no network and not the rest of mpitp's stack.
#
#   here (network, .venv):  bash bench/gpu_carry.sh prepare     # .whl/ and .devcarry/shared, both git-ignored
#   there (no network):     bash bench/gpu_carry.sh drill [gpu_drill.py options]
#
# prepare: wheels for the GPU image's Python (GPU_PYTHON, default 3.12) of the packages that image lacked or had too
# old (this workplace's CUDA image, 2026-11: torch 2.11, transformers 5.17, huggingface_hub 1.33, no lm-eval, no MPI
# library), at the versions of .venv (the tested environment); torch, numpy, pandas, pyarrow, scipy, scikit-learn,
# tokenizers, hf-xet and h5py are left to the image (pyarrow alone is ~40 MB: a device tool carrying 64 MiB with the
# working tree has no room for it). Then the parts of ../shared the drill reads: the GPT-2 tokenizer and the data files
# its tasks' templates (tests/tasks/<task>.yaml) name; the other templates' files are left empty (tests/support/tasks
# checks that they exist; the drill never loads them). Together about 60 MiB.
# drill: the wheels under the prefix /tmp/site (--no-deps: the image's own packages stay), ../shared pointed at the
# carried copy, then the drill itself.
set -euo pipefail
cd "$(dirname "$0")/.."
CARRY="lm_eval datasets evaluate dill multiprocess sqlitedict word2number rouge_score pytablewriter DataProperty
mbstrdecoder pathvalidate tabledata tcolorpy typepy chardet more-itertools tomlkit truststore httpx2 httpcore2 kernels
mpich mpi4py pydantic pydantic_core annotated-types typing-inspection transformers huggingface_hub accelerate typer
click fsspec filelock tqdm packaging typing_extensions pytz"
SDIST_ONLY="sqlitedict word2number rouge_score"
DRILL_TASKS="arc_easy_local wikitext_local gsm8k_local"  # bench/gpu_drill.py's TASKS

prepare() {
    local py=.venv/bin/python ver=${GPU_PYTHON:-3.12} name pin frozen template f
    rm -rf .whl .devcarry && mkdir -p .whl .devcarry/shared/tokenizers
    frozen=$($py -m pip freeze --exclude-editable)
    for name in $CARRY; do
        pin=$(grep -i -E "^${name//[-_]/[-_]}==" <<<"$frozen") || { echo "not in .venv: $name"; exit 2; }
        if [[ " $SDIST_ONLY " == *" $name "* ]]; then
            $py -m pip wheel -q --no-deps -w .whl "$pin"
        else
            $py -m pip download -q --no-deps --only-binary=:all: --python-version "$ver" --implementation cp \
                --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
                --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 \
                -d .whl "$pin"
        fi
    done
    cp -r ../shared/tokenizers/gpt2 .devcarry/shared/tokenizers/
    for template in tests/tasks/*.yaml; do
        for f in $(grep -o "shared/data/[^ ]*" "$template"); do
            mkdir -p ".devcarry/$(dirname "$f")"
            if [[ " $DRILL_TASKS " == *" $(basename "$template" .yaml) "* ]]; then cp "../$f" ".devcarry/$f"
            else : >".devcarry/$f"; fi
        done
    done
    chmod -R u+w .devcarry
    du -sh .whl .devcarry
}

drill() {
    # --prefix, not --target: the MPICH wheel's libmpi lands in <prefix>/lib only then (--target drops it)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --prefix /tmp/site .whl/*.whl
    local site
    site=$(python3 -c "import sysconfig; print(sysconfig.get_path('purelib', vars={'base': '/tmp/site'}))")
    export PYTHONPATH=$site:$PWD PATH=/tmp/site/bin:$PATH
    export LD_LIBRARY_PATH=/tmp/site/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
    # lm-eval's reference loads through transformers 5.25's default kernelization, which fetches Hub kernels and
    # fails offline on a GPU (mpitp's own loads pass use_kernels=False: replica.loading.LOAD_DEFAULTS)
    export USE_HUB_KERNELS=NO
    [ -e ../shared ] || ln -s "$PWD/.devcarry/shared" ../shared
    python3 -c "import torch, transformers, lm_eval, datasets, mpi4py.MPI as M; print('torch', torch.__version__,
        'cuda', torch.cuda.device_count(), 'transformers', transformers.__version__, M.Get_library_version()[:40])"
    mpiexec -n 2 python3 -c "from mpi4py import MPI; print('rank', MPI.COMM_WORLD.rank, 'of', MPI.COMM_WORLD.size)"
    python3 bench/gpu_drill.py "$@"
}

case "${1:-}" in
    prepare) prepare ;;
    drill) shift; drill "$@" ;;
    *) echo "usage: bash bench/gpu_carry.sh prepare | drill [gpu_drill.py options]" >&2; exit 2 ;;
esac
