"""The vocabulary-split input embedding summed over MPI (mpitp.replica.vocab_embedding): the lookups of every rank's
rows add up to the whole embedding's, bit for bit, and only plain embeddings split by vocabulary are taken."""

from __future__ import annotations

import pytest
import torch

from mpitp.errors import UsageError
from mpitp.replica import vocab_embedding


@pytest.mark.parametrize("vocab,tp", [(37, 3), (50257, 2), (5, 4), (8, 2)])
def test_rank_lookups_sum_to_the_whole_embedding(vocab, tp):
    torch.manual_seed(0)
    full = torch.randn(vocab, 6)
    chunk = -(-vocab // tp)  # DTensor's Shard(0) split, as torch.chunk's: ceil(vocab / tp) rows, the last fewer or none
    parts = [(min(r * chunk, vocab), min(chunk, vocab - min(r * chunk, vocab))) for r in range(tp)]
    assert sum(rows for _, rows in parts) == vocab  # every row on exactly one rank
    ids = torch.tensor([[0, vocab - 1] + [r * -(-vocab // tp) + d for r in range(tp) for d in (-1, 0)
                                         if 0 <= r * -(-vocab // tp) + d < vocab]])
    ids = torch.cat([ids, torch.randint(0, vocab, (1, ids.shape[1]))])
    outs, reduced = [], []
    for start, rows in parts:
        outs.append(vocab_embedding.lookup(ids, full[start:start + rows], start, reduced.append, vocab))
    assert len(reduced) == tp and all(o is r for o, r in zip(outs, reduced))  # the lookup itself goes to the sum
    total = outs[0]
    for o in outs[1:]:
        total = total + o
    assert torch.equal(total, torch.nn.functional.embedding(ids, full))
    for (start, rows), o in zip(parts, outs):
        own = (ids >= start) & (ids < start + rows)
        assert torch.equal(o[~own], torch.zeros_like(o[~own]))  # a rank adds zeros for rows it does not hold
    for bad in (vocab, -1):  # one process's lookup raises; the summed one must not give a row of zeros instead
        with pytest.raises(UsageError, match=f"token id {bad} is outside the model's input embedding of {vocab} rows"):
            vocab_embedding.lookup(torch.tensor([[0, bad]]), full[: parts[0][1]], 0, reduced.append, vocab)


def test_install_takes_plain_vocabulary_split_embeddings_only(gloo_world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    class Scaled(torch.nn.Embedding):  # scales inside its forward: left on transformers' path
        def forward(self, ids):
            return super().forward(ids) * 2.0

    mesh = init_device_mesh("cpu", (1,))
    torch.manual_seed(0)
    model = torch.nn.ModuleDict(dict(plain=torch.nn.Embedding(11, 4), scaled=Scaled(11, 4),
                                     norm=torch.nn.Embedding(11, 4, max_norm=1.0),
                                     hidden=torch.nn.Embedding(11, 4), whole=torch.nn.Embedding(11, 4)))
    ref = {k: m.weight.detach().clone() for k, m in model.items()}
    for name, placement in dict(plain=Shard(0), scaled=Shard(0), norm=Shard(0), hidden=Shard(1),
                                whole=Replicate()).items():
        m = model[name]
        m.weight = torch.nn.Parameter(distribute_tensor(m.weight.detach(), mesh, [placement]), requires_grad=False)
    assert vocab_embedding.install(model, tp=1) == 1
    assert set(k for k, m in model.items() if "forward" in vars(m)) == {"plain"}
    ids = torch.tensor([[0, 5, 10, 3]])
    with torch.no_grad():
        out = model["plain"](ids)
    assert type(out) is torch.Tensor and torch.equal(out, torch.nn.functional.embedding(ids, ref["plain"]))
    assert vocab_embedding.install(model, tp=2) == 0  # a mesh that is not the whole TP group: not taken
