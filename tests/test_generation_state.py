"""The leader encodes each generate forward's arguments and a worker decodes them back (mpitp.replica.generation):
a grown attention mask travels as a marker, the KV cache as each rank's own. Real generation under TP/PP is covered
by the parity tests; this checks the encoding alone, leader and worker state side by side in one process."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mpitp.replica.generation import CACHE, EXTEND_ONES, STATE, GenerationState, chosen_token_logits
from mpitp.replica.scoring import CommCounter
from support import tiny_llama


def _shard():
    from transformers import DynamicCache, LlamaConfig

    config = LlamaConfig(num_hidden_layers=1, hidden_size=8, intermediate_size=16, num_attention_heads=2,
                         vocab_size=11)
    ops = SimpleNamespace(reduce_counter=CommCounter())
    return SimpleNamespace(model=SimpleNamespace(config=config), ops=ops, pipeline=True), DynamicCache


def test_forward_arguments_round_trip_with_mask_growth_and_cache():
    shard, DynamicCache = _shard()
    leader, worker = GenerationState(shard), GenerationState(shard)
    scoring = shard.ops.reduce_counter
    leader.begin(greedy=False)
    worker.begin(greedy=False)
    assert shard.ops.reduce_counter is not scoring  # argmax traffic is not counted as scoring
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[0, 0] = 0
    steps = [dict(input_ids=torch.arange(10).view(2, 5), attention_mask=mask, past_key_values=DynamicCache(),
                  use_cache=True, logits_to_keep=1)]
    grown = mask
    for t in range(3):
        grown = torch.cat([grown, torch.ones(2, 1, dtype=torch.long)], dim=1)
        steps.append(dict(input_ids=torch.tensor([[t], [t + 1]]), attention_mask=grown,
                          past_key_values=steps[0]["past_key_values"], use_cache=True, logits_to_keep=1))
    caches = set()
    for i, kwargs in enumerate(steps):
        plain, tensors = leader.encode(kwargs)
        assert plain["past_key_values"] == CACHE and plain["use_cache"] is True
        assert ("attention_mask" in tensors) == (i == 0) and (plain.get("attention_mask") == EXTEND_ONES) == (i > 0)
        got = worker.decode(plain, {k: v.clone() for k, v in tensors.items()})
        assert set(got) == set(kwargs)
        for k, v in kwargs.items():
            if torch.is_tensor(v):
                assert torch.equal(got[k], v), k
        assert isinstance(got["past_key_values"], DynamicCache) and got["past_key_values"] is not kwargs[
            "past_key_values"]
        caches.add(id(got["past_key_values"]))
    assert len(caches) == 1  # the worker keeps one cache of its own for the whole call
    worker.end()
    leader.end()
    assert shard.ops.reduce_counter is scoring
    leader.begin(greedy=False)  # a new call starts from nothing: no stale mask to extend
    plain, tensors = leader.encode(dict(attention_mask=grown))
    assert "attention_mask" in tensors


def test_a_recurrent_state_is_each_ranks_own():
    """RWKV's ``generate`` passes back the ``state`` list its forward returned: it travels as a marker, and the worker
    passes the state its own previous forward returned (with TP, its channels' part), never the leader's."""
    shard, _ = _shard()
    leader, worker = GenerationState(shard), GenerationState(shard)
    leader.begin(greedy=False)
    worker.begin(greedy=False)
    plain, tensors = leader.encode(dict(input_ids=torch.arange(4).view(1, 4), state=None, use_cache=True))
    assert plain["state"] is None and worker.decode(plain, tensors)["state"] is None  # the first forward: none yet
    own = [torch.zeros(1, 3, 2) for _ in range(5)]
    worker.keep_state(own)
    plain, tensors = leader.encode(dict(input_ids=torch.tensor([[7]]), state=[torch.ones(1, 6, 2)] * 5))
    assert plain["state"] == STATE and "state" not in tensors
    assert worker.decode(plain, tensors)["state"] is own
    worker.end()
    worker.begin(greedy=False)  # a new call starts without the last call's state
    assert worker.decode({"state": STATE}, {})["state"] is None


def test_unmirrorable_argument_is_refused():
    shard, _ = _shard()
    state = GenerationState(shard)
    state.begin(greedy=False)
    with pytest.raises(TypeError, match="cannot mirror forward argument extra=list"):
        state.encode(dict(extra=[1, 2]))


def test_chosen_token_logits_pick_the_id_and_report_nan_rows():
    seen = []
    logits = chosen_token_logits(torch.tensor([3, 11]), 11, lambda: seen.append(True))
    assert logits.shape == (2, 1, 11) and logits.argmax(-1).view(-1).tolist() == [3, 0]
    assert seen == [True]  # id 11 is past the vocabulary: no logit reached the maximum
    assert float(logits[0, 0, 3]) == 0.0 and bool(torch.isinf(logits[0, 0, :3]).all())


def test_greedy_head_swaps_in_where_a_family_names_its_head_and_reads_its_dtype():
    """The greedy stand-in replaces the head the model itself names (GPT-NeoX-Japanese's ``embed_out``, found through
    the model's own ``get_output_embeddings``; the base class's answer missed it and generation died after the load)
    and answers ``.weight`` (Mamba's forward casts its hidden state to ``lm_head.weight.dtype``). Both scored at tp=1
    against lm-eval in bench/arch_matrix.py (3.5e-7, 1.1e-7)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from mpitp import compat
    from mpitp.replica.generation import GreedyHead

    cfg = AutoConfig.for_model("gpt_neox_japanese", hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                               intermediate_multiple_size=2, vocab_size=64, bos_token_id=0, eos_token_id=1)
    model = AutoModelForCausalLM.from_config(cfg)
    head = model.get_output_embeddings()
    stand_in = GreedyHead(SimpleNamespace(weight=head.weight, vocab_size=64))
    assert stand_in.weight is head.weight
    with compat.output_head_replaced(model, stand_in) as replaced:
        assert replaced is head and model.embed_out is stand_in
    assert model.embed_out is head


def _tiny_llama(seed: int = 0):
    return tiny_llama(seed)


def test_growing_layer_holds_what_a_dynamic_layer_holds_and_adopts_outside_changes():
    """Prefill, decode steps past the reserve (the buffer doubles), then a crop and a batch selection from outside
    (new tensors in ``keys``): after each update the keys and values equal DynamicLayer's, as views of one buffer."""
    from transformers.cache_utils import DynamicLayer

    from mpitp.replica.generation import GrowingLayer

    torch.manual_seed(0)
    ours, theirs = GrowingLayer(reserve=2), DynamicLayer()
    steps = [torch.randn(3, 2, 5, 4)] + [torch.randn(3, 2, 1, 4) for _ in range(4)]
    for i, k in enumerate(steps):
        if i == 3:
            ours.crop(-1)
            theirs.crop(-1)
        if i == 4:
            keep = torch.tensor([0, 2])
            ours.batch_select_indices(keep)
            theirs.batch_select_indices(keep)
            k = k[:2]
        got, want = ours.update(k, -k), theirs.update(k, -k)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), i
        assert ours.get_seq_length() == theirs.get_seq_length()
        assert got[0].data_ptr() == ours.buffers[0].data_ptr()  # a view of the buffer, no new copy
    assert ours.buffers[0].shape[-2] >= 8  # 5 + reserve 2 = 7 was outgrown: doubled


@pytest.mark.parametrize("batch", [1, 3])
def test_growing_cache_generates_the_same_bits_as_dynamic_cache(batch):
    """Greedy generation with :class:`GrowingCache` gives DynamicCache's tokens and the very same logits at every
    step (bitwise), unpadded and left-padded (the attention reads views strided by the buffer's capacity)."""
    from mpitp.replica.generation import GrowingCache

    model = _tiny_llama()
    torch.manual_seed(1)
    ids = torch.randint(1, 97, (batch, 9))
    mask = torch.ones_like(ids)
    if batch > 1:
        ids[1, :3], mask[1, :3] = 0, 0  # left padding, as lm-eval's tok_batch_encode pads
    kw = dict(input_ids=ids, attention_mask=mask, max_length=9 + 12, do_sample=False, pad_token_id=0,
              output_scores=True, return_dict_in_generate=True, use_cache=True)
    with torch.no_grad():
        ref = model.generate(**kw)
        cache = GrowingCache(model.config, reserve=12)
        got = model.generate(**kw, cache=cache)  # generate's name for a caller's cache
    assert torch.equal(got.sequences, ref.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.scores, ref.scores))
    assert cache.layers[0].buffers[0].shape[-2] == 9 + 12  # sized once: the reserve was exactly enough


def test_greedy_decode_steps_ship_no_tensor():
    """With the greedy head, a decode step's input ids are the tokens every rank's head just chose and its positions
    the previous ones plus one: the leader sends markers only, the worker rebuilds the same tensors. A finished
    row's pad token (not the head's choice) makes the ids travel as a tensor again."""
    from mpitp.replica.generation import GREEDY_IDS, NEXT_POSITION

    shard, _ = _shard()
    leader, worker = GenerationState(shard), GenerationState(shard)
    leader.begin(greedy=False)
    worker.begin(greedy=False)
    prompt = dict(input_ids=torch.arange(10).view(2, 5), cache_position=torch.arange(5),
                  position_ids=torch.arange(5).repeat(2, 1))
    plain, tensors = leader.encode(prompt)
    worker.decode(plain, {k: v.clone() for k, v in tensors.items()})
    assert set(tensors) == set(prompt)
    for step, chosen in enumerate([torch.tensor([7, 3]), torch.tensor([4, 4])]):
        for state in (leader, worker):  # GreedyHead.forward tells each rank's state the same ids
            state.note_ids(chosen.clone())
        kwargs = dict(input_ids=chosen.view(2, 1), cache_position=torch.tensor([5 + step]),
                      position_ids=torch.tensor([[5 + step], [5 + step]]))
        plain, tensors = leader.encode(kwargs)
        assert tensors == {} and plain == dict(input_ids=GREEDY_IDS, cache_position=NEXT_POSITION,
                                               position_ids=NEXT_POSITION)
        got = worker.decode(plain, {})
        assert all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in kwargs.items())
    leader.note_ids(torch.tensor([1, 2]))
    plain, tensors = leader.encode(dict(input_ids=torch.tensor([[1], [0]])))  # row 1 finished: the pad token
    assert "input_ids" in tensors
