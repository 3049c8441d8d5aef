"""loader.py's rules at their limits: the sample order pinned by golden values (any change to the
hash, the Feistel network or its rounds changes which samples a resumed job reads), the exact
indices each rank's microbatches take, every input check just inside and just outside its
bound with the message that names it, and state_dict / resume round trips.

The golden values were computed from the code as it is: a change that moves them is a change
of the on-disk contract (a resumed job would read other samples), not a refactor."""

from __future__ import annotations

import threading
import types

import numpy as np
import pytest
import torch

from optimus.data import DataError, SyntheticCorpus, TokenShards
from optimus.data.loader import MicrobatchSampler, WindowDataset, build_loader, build_source
from optimus.data.mixture import Mixture
from optimus.data.order import FeistelPermutation, SampleOrder, _mix64, block_permutation
from optimus.data.prepare import prepare

SEQ = 8


class Ramp:
    """Token t is the number t: a window shows which sample it is. Reads past the end fail."""

    def __init__(self, num_tokens: int):
        self.num_tokens = num_tokens

    def read(self, start: int, length: int) -> np.ndarray:
        if start < 0 or start + length > self.num_tokens:
            raise IndexError(f"read [{start}, {start + length}) of {self.num_tokens} tokens")
        return np.arange(start, start + length, dtype=np.int64)


def _loader(samples=50, seed=0, dp_rank=0, dp_size=1, batch_size=8, microbatches=2, **kw):
    return build_loader(Ramp(SEQ * samples + 1), seq_len=SEQ, batch_size=batch_size,
                        microbatches=microbatches, dp_rank=dp_rank, dp_size=dp_size, seed=seed,
                        **kw)


def _take(loader, n):
    it = iter(loader)
    batches = [next(it) for _ in range(n)]
    return ([b["index"].tolist() for b in batches], [b["sample_ids"].tolist() for b in batches])


# --- the hash and the permutation, pinned ------------------------------------------------------

def test_mix64_is_the_splitmix64_finalizer():
    assert _mix64(0) == 0xE220A8397B1DCDAF  # splitmix64's first output from state 0
    assert _mix64(1) == 0x910A2DEC89025CC1
    assert _mix64((1 << 64) - 1) == 0xE4D971771B652C20


@pytest.mark.parametrize("n, order", [
    (1, [0]),
    (2, [1, 0]),
    (3, [1, 2, 0]),
    (4, [1, 3, 0, 2]),
    (5, [2, 3, 0, 1, 4]),
    (8, [2, 3, 0, 1, 4, 6, 5, 7]),
    (10, [8, 3, 0, 1, 4, 6, 5, 9, 2, 7]),
    (16, [8, 3, 0, 1, 15, 13, 5, 12, 2, 7, 4, 11, 9, 14, 6, 10]),
    (17, [14, 16, 8, 12, 10, 3, 7, 2, 9, 1, 0, 4, 5, 13, 11, 6, 15]),
])
def test_the_permutation_of_small_n_is_pinned(n, order):
    p = FeistelPermutation(n, key=12345)
    assert [p(i) for i in range(n)] == order


def test_the_permutation_of_large_n_is_pinned():
    p = FeistelPermutation(1000, key=7)
    assert [p(i) for i in range(12)] == [707, 328, 854, 995, 765, 670, 620, 422, 758, 237,
                                         472, 832]
    huge = FeistelPermutation(2**34, key=0)  # O(1) memory: no table of 2**34 entries
    assert [huge(i) for i in range(3)] == [15169286890, 11499022219, 7105907015]


def test_the_permutation_reads_its_key_modulo_2_to_the_64():
    ref = [FeistelPermutation(17, 12345)(i) for i in range(17)]
    assert [FeistelPermutation(17, 12345 + 2**64)(i) for i in range(17)] == ref
    minus_one = [FeistelPermutation(17, -1)(i) for i in range(17)]
    assert minus_one == [FeistelPermutation(17, 2**64 - 1)(i) for i in range(17)] != ref


@pytest.mark.parametrize(("seed", "block", "order"), [
    (0, 0, [11, 3, 1, 2, 4, 7, 6, 5, 0, 8, 10, 9]),
    (0, 1, [5, 2, 1, 3, 8, 0, 10, 7, 4, 9, 6, 11]),
    (1234, 7, [1, 10, 4, 9, 11, 6, 0, 7, 2, 3, 5, 8]),
    (2**63 + 5, 2**40, [8, 5, 0, 9, 1, 2, 7, 10, 4, 6, 3, 11]),
])
def test_a_mixture_blocks_permutation_is_pinned(seed, block, order):
    """Which source each slot of a mixture's block reads (seed and block number both key it)."""
    perm = block_permutation(seed, block, 12)
    assert [perm(i) for i in range(12)] == order


def test_the_permutation_needs_one_element():
    assert FeistelPermutation(1, key=3)(0) == 0
    with pytest.raises(ValueError, match=r"^permutation needs n >= 1, got 0$"):
        FeistelPermutation(0, key=3)


def test_the_permutation_takes_indices_in_0_to_n():
    p = FeistelPermutation(5, key=12345)
    assert (p(0), p(4)) == (2, 4)
    for outside in (-1, 5):
        with pytest.raises(IndexError, match=rf"^{outside} is outside \[0, 5\)$"):
            p(outside)


# --- the sample order: epoch e shuffled by (seed, e) -------------------------------------------

@pytest.mark.parametrize("seed, epochs", [
    (0, [[7, 6, 4, 1, 0, 9, 3, 2, 5, 8], [5, 2, 1, 4, 3, 0, 7, 8, 6, 9],
         [0, 1, 8, 3, 9, 5, 2, 4, 6, 7]]),
    (1, [[5, 0, 3, 6, 2, 8, 7, 4, 9, 1], [8, 6, 1, 4, 2, 5, 3, 9, 0, 7],
         [2, 0, 1, 5, 9, 6, 7, 4, 3, 8]]),
    (2**63 + 5, [[7, 5, 2, 3, 1, 9, 6, 0, 4, 8], [2, 0, 4, 8, 5, 9, 7, 6, 3, 1],
                 [6, 8, 7, 9, 3, 0, 4, 2, 5, 1]]),
])
def test_the_order_of_each_epoch_is_pinned(seed, epochs):
    order = SampleOrder(10, seed)
    assert [[order.sample_id(g) for g in range(e * 10, e * 10 + 10)] for e in range(3)] == epochs
    # Going back to an earlier epoch rebuilds its permutation: the order is a pure function.
    assert [order.sample_id(g) for g in (25, 3, 12, 0)] == [epochs[2][5], epochs[0][3],
                                                            epochs[1][2], epochs[0][0]]


def test_the_order_of_a_large_dataset_is_pinned_in_a_late_epoch():
    order = SampleOrder(1000, seed=3)
    assert [order.sample_id(g) for g in range(8)] == [326, 823, 98, 944, 808, 610, 654, 888]
    assert [order.sample_id(g) for g in range(5000, 5008)] == [84, 686, 305, 862, 276, 264,
                                                               246, 314]


def test_the_order_starts_at_global_index_0():
    order = SampleOrder(10, seed=0)
    assert order.sample_id(0) == 7
    with pytest.raises(IndexError, match=r"^global sample index must be >= 0, got -1$"):
        order.sample_id(-1)


# --- windows -----------------------------------------------------------------------------------

@pytest.mark.parametrize("num_tokens, samples", [
    (SEQ + 1, 1), (2 * SEQ, 1), (2 * SEQ + 1, 2), (3 * SEQ, 2)])
def test_a_source_holds_num_tokens_minus_1_over_seq_len_samples(num_tokens, samples):
    assert WindowDataset(Ramp(num_tokens), SEQ, seed=0).num_samples == samples


def test_a_source_shorter_than_one_window_is_refused_by_size():
    with pytest.raises(DataError, match=r"^the data holds 8 tokens, fewer than one sample of "
                                        r"seq_len \+ 1 = 9; use more data or a shorter seq_len$"):
        WindowDataset(Ramp(SEQ), SEQ, seed=0)


def test_item_g_is_the_window_of_its_sample_and_its_next_tokens():
    data = WindowDataset(Ramp(3 * SEQ + 1), SEQ, seed=0)  # 3 samples: every window's last token
    for g in range(6):
        j = data.sample_id(g)
        item = data[g]
        assert item["input_ids"].tolist() == list(range(j * SEQ, j * SEQ + SEQ))
        assert item["labels"].tolist() == list(range(j * SEQ + 1, j * SEQ + SEQ + 1))
        assert item["sample_ids"].item() == j and item["index"].item() == g
        assert item["input_ids"].dtype == item["index"].dtype == torch.long
    assert [data.sample_id(g) for g in range(6)] == [0, 2, 1, 1, 2, 0]


# --- the sampler: which global indices a rank's microbatches take ------------------------------

def test_a_rank_takes_its_slice_of_each_global_microbatch():
    s = MicrobatchSampler(batch_size=12, microbatches=3, dp_rank=1, dp_size=2)
    assert iter(s) is s
    assert [next(s) for _ in range(7)] == [[2, 3], [6, 7], [10, 11], [14, 15], [18, 19],
                                           [22, 23], [26, 27]]
    assert s.state_dict() == {"next_index": 24, "microbatch": 1, "layout": [12, 3, 2]}


def test_the_sampler_starts_at_start_index_and_its_state_carries_the_data_key():
    s = MicrobatchSampler(batch_size=4, microbatches=1, dp_rank=0, dp_size=1, start_index=8,
                          data_key={"seed": 3})
    assert s.state_dict() == {"next_index": 8, "microbatch": 0, "layout": [4, 1, 1], "seed": 3}
    assert next(s) == [8, 9, 10, 11] and s.state_dict()["next_index"] == 12


def test_a_saved_state_must_match_the_data_key():
    s = MicrobatchSampler(batch_size=4, microbatches=2, dp_rank=0, dp_size=1,
                          data_key={"seed": 0, "seq_len": 8})
    state = {"next_index": 4, "microbatch": 1, "layout": [4, 2, 1], "seed": 0, "seq_len": 8}
    for bad, shown in (({"seed": 9}, "seed=9 but this run has seed=0"),
                       ({"seq_len": None}, "seq_len=None but this run has seq_len=8")):
        with pytest.raises(DataError, match=rf"^the saved data state has {shown}; resume with "
                                            "the same data settings or start the data from "
                                            "scratch$"):
            s.load_state_dict({**state, **bad})
    s.load_state_dict(state)
    assert (s.next_index, s.microbatch) == (4, 1) and next(s) == [6, 7]


def test_only_a_mid_step_state_needs_the_same_layout():
    s = MicrobatchSampler(batch_size=8, microbatches=2, dp_rank=1, dp_size=4)
    with pytest.raises(DataError, match=r"^the saved data state is mid-step, so it can only "
                                        r"resume with the same batch_size, microbatches and "
                                        r"dp_size \[8, 2, 2\]; save at a step boundary$"):
        s.load_state_dict({"next_index": 16, "microbatch": 1, "layout": [8, 2, 2]})
    s.load_state_dict({"next_index": 16, "microbatch": 1, "layout": [8, 2, 4]})
    assert next(s) == [21]
    s.load_state_dict({"next_index": 24, "microbatch": 0, "layout": [8, 2, 2]})
    assert next(s) == [25]


# --- build_loader's checks, each at its limit --------------------------------------------------

@pytest.mark.parametrize("bad, message", [
    ({"seq_len": 0}, "seq_len must be >= 1, got 0"),
    ({"microbatches": 0}, "microbatches must be >= 1, got 0"),
    ({"dp_size": 0, "dp_rank": 0}, "dp_size must be >= 1, got 0"),
    ({"dp_size": 2, "dp_rank": -1}, r"dp_rank must be in \[0, 2\), got -1"),
    ({"dp_size": 2, "dp_rank": 2}, r"dp_rank must be in \[0, 2\), got 2"),
    ({"batch_size": 0}, "batch_size 0 must be a positive multiple of microbatches x dp_size "
                        "= 1 x 1; change batch_size or microbatches"),
    ({"batch_size": 12, "microbatches": 2, "dp_size": 4},
     "batch_size 12 must be a positive multiple of microbatches x dp_size = 2 x 4"),
    ({"seed": -1}, "seed must be >= 0, got -1"),
    ({"start_index": -1}, "start_index must be >= 0, got -1"),
    ({"num_workers": -1}, "num_workers must be >= 0, got -1"),
    ({"prefetch_factor": 0}, "prefetch_factor must be >= 1, got 0"),
])
def test_build_loader_refuses_each_setting_just_past_its_limit(bad, message):
    args = {"seq_len": 1, "batch_size": 1, "microbatches": 1, "dp_rank": 0, "dp_size": 1,
            "seed": 0, **bad}
    with pytest.raises(DataError, match=f"^{message}"):
        build_loader(Ramp(100), **args)


def test_build_loader_takes_each_setting_at_its_limit():
    loader = build_loader(Ramp(2), seq_len=1, batch_size=1, microbatches=1, dp_rank=0,
                          dp_size=1, seed=0, start_index=0, num_workers=0, prefetch_factor=1)
    assert _take(loader, 2) == ([[0], [1]], [[0], [0]])
    last = build_loader(Ramp(SEQ * 50 + 1), seq_len=SEQ, batch_size=6, microbatches=3,
                        dp_rank=1, dp_size=2, seed=0)
    assert _take(last, 3)[0] == [[1], [3], [5]]


def test_build_loader_defaults_start_at_0_in_this_process():
    loader = _loader()
    assert (loader.num_workers, loader.prefetch_factor) == (0, None)
    assert _take(loader, 1)[0] == [[0, 1, 2, 3]]
    assert build_source("synthetic", vocab_size=257).seed == 0


_HELD = threading.Lock()  # held by a thread of the test process while its loader's workers read


class LockedRamp(Ramp):
    """A Ramp that reads only where _HELD is free: in a process forked from the test's, the
    lock is held (a fork copies it as the holding thread left it), in a fresh one it is not."""

    def read(self, start: int, length: int) -> np.ndarray:
        if not _HELD.acquire(blocking=False):
            raise RuntimeError("this worker inherited a lock another thread of its parent held")
        _HELD.release()
        return super().read(start, length)


def test_workers_do_not_inherit_the_ranks_threads_half_way():
    """A rank's threads (collectives, heartbeat, checkpoint writer, torch's pools) hold locks
    at any moment; a worker forked from the rank inherits them held (and a pool half-built:
    SIGSEGV at start-up). The loader's workers come from a forkserver, so a lock one of the
    rank's threads holds while they start is free in them, and they read what num_workers=0
    reads."""
    loader = build_loader(LockedRamp(SEQ * 50 + 1), seq_len=SEQ, batch_size=8, microbatches=2,
                          dp_rank=0, dp_size=1, seed=0, num_workers=2)
    assert loader.multiprocessing_context.get_start_method() == "forkserver"
    held, done = threading.Event(), threading.Event()
    holder = threading.Thread(target=lambda: (_HELD.acquire(), held.set(), done.wait(60),
                                              _HELD.release()))
    holder.start()
    try:
        held.wait(60)
        assert _take(loader, 6) == _take(_loader(), 6)
    finally:
        done.set()
        holder.join()


def test_prefetch_factor_is_passed_only_with_workers():
    assert _loader(num_workers=1).prefetch_factor == 2  # built, never iterated: no process
    assert _loader(num_workers=1, prefetch_factor=3).prefetch_factor == 3
    assert _loader(num_workers=0, prefetch_factor=3).prefetch_factor is None


# --- what each rank reads, pinned --------------------------------------------------------------

@pytest.mark.parametrize("kw, indices, samples", [
    ({}, [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
     [[29, 22, 24, 10], [7, 39, 42, 18], [33, 49, 46, 8], [11, 47, 20, 40]]),
    ({"dp_rank": 1, "dp_size": 2}, [[2, 3], [6, 7], [10, 11], [14, 15]],
     [[24, 10], [42, 18], [46, 8], [20, 40]]),
    ({"dp_rank": 3, "dp_size": 4}, [[3], [7], [11], [15]], [[10], [18], [8], [40]]),
    ({"samples": 13, "seed": 7, "dp_rank": 1, "dp_size": 2}, [[2, 3], [6, 7], [10, 11],
                                                              [14, 15]],
     [[2, 8], [9, 0], [4, 10], [6, 2]]),  # crosses into the second epoch at index 13
    ({"samples": 13, "seed": 7, "dp_rank": 1, "dp_size": 2, "start_index": 24},
     [[26, 27], [30, 31], [34, 35], [38, 39]], [[2, 6], [3, 7], [10, 11], [8, 9]]),
    ({"samples": 1000, "seed": 2**40, "batch_size": 4, "microbatches": 1},
     [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
     [[424, 582, 168, 36], [320, 195, 583, 77], [873, 742, 292, 462], [420, 112, 352, 989]]),
])
def test_a_ranks_first_batches_are_pinned(kw, indices, samples):
    assert _take(_loader(**kw), 4) == (indices, samples)


def test_each_batch_holds_the_windows_of_its_samples():
    batch = next(iter(_loader(dp_rank=1, dp_size=2)))
    assert batch["sample_ids"].tolist() == [24, 10]
    assert batch["input_ids"].tolist() == [list(range(192, 200)), list(range(80, 88))]
    assert batch["labels"].tolist() == [list(range(193, 201)), list(range(81, 89))]


# --- state_dict and resume ---------------------------------------------------------------------

def test_the_loader_state_is_the_next_step_and_the_data_settings():
    loader = _loader(dp_rank=1, dp_size=2)
    _take(loader, 3)  # mid-step: one microbatch of step 1 read
    assert loader.state_dict()["_index_sampler_state"] == {
        "next_index": 8, "microbatch": 1, "layout": [8, 2, 2], "seed": 0, "seq_len": SEQ,
        "num_samples": 50}


def test_resuming_mid_step_reads_what_an_uninterrupted_run_reads():
    ref = _take(_loader(dp_rank=1, dp_size=2), 7)
    first = _loader(dp_rank=1, dp_size=2)
    head = _take(first, 3)
    resumed = _loader(dp_rank=1, dp_size=2)
    resumed.load_state_dict(first.state_dict())
    tail = _take(resumed, 4)
    assert (head[0] + tail[0], head[1] + tail[1]) == ref


def test_resuming_at_a_step_boundary_at_another_dp_reads_the_same_steps():
    first = _loader(dp_rank=0, dp_size=2)
    _take(first, 4)  # two whole steps
    ranks = []
    for r in range(4):
        resumed = _loader(dp_rank=r, dp_size=4)
        resumed.load_state_dict(first.state_dict())
        ranks.append(_take(resumed, 2)[0])
    assert ranks == [[[16], [20]], [[17], [21]], [[18], [22]], [[19], [23]]]


def test_a_state_from_other_data_is_refused_when_the_loader_resumes():
    first = _loader(samples=50)
    _take(first, 2)
    for other, shown in ((_loader(samples=51), "num_samples=50 but this run has num_samples=51"),
                         (_loader(seed=4), "seed=0 but this run has seed=4")):
        other.load_state_dict(first.state_dict())
        with pytest.raises(DataError, match=f"the saved data state has {shown}"):
            next(iter(other))


class _Windows:
    """A source that makes its own dataset, as a Mixture does."""

    def windows(self, seq_len, seed):
        return types.SimpleNamespace(num_samples=seq_len * 100 + seed, data_key={"block": 5})


def test_a_source_with_its_own_windows_adds_its_data_key():
    loader = build_loader(_Windows(), seq_len=3, batch_size=2, microbatches=1, dp_rank=0,
                          dp_size=1, seed=4)
    assert loader.dataset.num_samples == 304
    assert loader.batch_sampler.data_key == {"seed": 4, "seq_len": 3, "num_samples": 304,
                                             "block": 5}


# --- build_source ------------------------------------------------------------------------------

@pytest.fixture
def prepared(tmp_path):
    """Two prepared folders of byte tokens (vocab_size 257)."""
    out = []
    for name in ("a", "b"):
        text = tmp_path / f"{name}.txt"
        text.write_text(f"document {name} " * 20)
        prepare([text], tmp_path / name)
        out.append(str(tmp_path / name))
    return out


def test_build_source_reads_the_kind_or_the_data_section(prepared):
    synthetic = build_source("synthetic", vocab_size=300, seed=5)
    assert isinstance(synthetic, SyntheticCorpus)
    assert (synthetic.vocab_size, synthetic.seed) == (300, 5)
    section = types.SimpleNamespace(source="shards", path=prepared[0], sources=None)
    shards = build_source(section, vocab_size=257)
    assert isinstance(shards, TokenShards) and str(shards.path) == prepared[0]
    with pytest.raises(DataError, match=r"^unknown data kind 'web'; use 'synthetic' or "
                                        r"'shards'$"):
        build_source("web", vocab_size=257)


def test_build_source_makes_a_mixture_of_dicts_or_objects(prepared):
    sources = [{"path": prepared[0], "weight": 1},
               types.SimpleNamespace(path=prepared[1], weight=3)]
    mixture = build_source("shards", vocab_size=257, sources=sources)
    assert isinstance(mixture, Mixture) and mixture.weights == [1.0, 3.0]
    assert [str(s.path) for s in mixture.sources] == prepared


def test_build_source_needs_exactly_one_of_path_and_sources(prepared):
    with pytest.raises(DataError, match=r"^set data.path \(one source\) or data.sources \(a "
                                        r"mixture\), not both$"):
        build_source("shards", path=prepared[0], vocab_size=257,
                     sources=[{"path": prepared[1], "weight": 1}])
    with pytest.raises(DataError, match=r"^data kind 'shards' needs a path to a prepared "
                                        r"folder$"):
        build_source("shards", vocab_size=257)


def test_the_model_vocabulary_must_hold_the_datas(prepared):
    assert build_source("shards", path=prepared[0], vocab_size=257).vocab_size == 257
    with pytest.raises(DataError, match=rf"^the data in {prepared[0]} was tokenized with "
                                        r"vocab_size 257, larger than the model's vocab_size "
                                        r"256; raise the model's vocab_size to at least 257 or "
                                        r"prepare the data with a matching tokenizer$"):
        build_source("shards", path=prepared[0], vocab_size=256)
    with pytest.raises(DataError, match="vocab_size 257, larger than the model's vocab_size 256"):
        build_source("shards", vocab_size=256, sources=[{"path": prepared[1], "weight": 1}])
