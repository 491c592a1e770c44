"""``RankBatches``: each dp rank reads only its share of every global batch, and training on the shares
(``train_step(pre_sharded=True)``) equals training on the global batch.

Default tier: on a memory-mapped .npy and a torch-saved tensor, two dp ranks' reads (every slice the
file is asked for is recorded) cover exactly the global batch's rows, each rank only its own half;
the position resumes exactly; bad files and positions are refused. Matrix: a (2, 1, 2) launch on 4
ranks trains 3 steps on shares and 3 steps on the global batch: the losses are equal.
"""
from __future__ import annotations

import numpy
import pytest
import torch

import xirang
from examples.gpt import GPTConfig, build_gpt
from xirang.codegen.runtime.launch.launcher import launch
from xirang.codegen.runtime.data.rank_batches import RankBatches, SyntheticTokens, TokenFile
from xirang.ir.errors import XirangError

SEQ, GLOBAL_BATCH, VOCAB = 8, 4, 97


class RecordingArray:
    """Stands for the memory-mapped array: records every span read from it."""

    def __init__(self, array):
        self.array, self.spans = array, []
        self.shape, self.ndim, self.dtype = array.shape, array.ndim, array.dtype

    def __getitem__(self, key):
        self.spans.append((key.start, key.stop))
        return self.array[key]


@pytest.fixture(params=["npy", "pt"])
def token_file(request, tmp_path):
    ids = numpy.arange(1000, dtype=numpy.int32) % VOCAB
    if request.param == "npy":
        path = tmp_path / "tokens.npy"
        numpy.save(path, ids)
    else:
        path = tmp_path / "tokens.pt"
        torch.save(torch.from_numpy(ids.astype(numpy.int64)), path)
    return path, ids


def test_each_rank_reads_only_its_rows(token_file):
    path, ids = token_file
    ranks = [RankBatches(TokenFile(path), global_batch=GLOBAL_BATCH, seq=SEQ, dp=2, dp_rank=d, shift_labels=True)
             for d in range(2)]
    whole = RankBatches(TokenFile(path), global_batch=GLOBAL_BATCH, seq=SEQ, shift_labels=True)
    for batches in ranks:
        batches.source.tokens = RecordingArray(batches.source.tokens)
    for step in range(5):
        want = whole.batch_at(step, share=False)
        shares = [batches.next_batch() for batches in ranks]
        for name in ("input_ids", "labels"):
            assert torch.equal(torch.cat([share[name] for share in shares]), want[name])
        assert torch.equal(want["labels"][:, :-1], want["input_ids"][:, 1:])  # labels are the next tokens
    rows_of_step = [set(), set()]
    for rank, batches in enumerate(ranks):
        assert batches.rows_read == 5 * GLOBAL_BATCH // 2
        read_rows = {start // (SEQ + 1) for start, stop in batches.source.tokens.spans}
        assert all(stop - start == SEQ + 1 for start, stop in batches.source.tokens.spans)
        mine = {row for step in range(5) for row in batches.rows_of(step)}
        assert read_rows == mine
        rows_of_step[rank] = mine
    assert not rows_of_step[0] & rows_of_step[1]  # no row read by both ranks
    # a file row is its tokens: spot-check one against the array
    row = ranks[0].rows_of(0)[0]
    assert ranks[0].batch_at(0)["input_ids"][0].tolist() == ids[row * (SEQ + 1):row * (SEQ + 1) + SEQ].tolist()


def test_the_position_resumes_exactly_and_epochs_reshuffle():
    source = SyntheticTokens(VOCAB, length=10 * SEQ * GLOBAL_BATCH, seed=3)
    first = RankBatches(source, global_batch=GLOBAL_BATCH, seq=SEQ, dp=2, dp_rank=1)
    for _ in range(7):
        first.next_batch()
    saved = first.state_dict()
    later = [first.next_batch() for _ in range(6)]  # crosses into the second epoch (10 batches each)
    resumed = RankBatches(source, global_batch=GLOBAL_BATCH, seq=SEQ, dp=2, dp_rank=1)
    resumed.load_state_dict(saved)
    for want in later:
        got = resumed.next_batch()
        assert all(torch.equal(got[k], want[k]) for k in want)
    assert first.rows_of(0) != first.rows_of(10)  # epoch 2 is another order of the same rows
    epoch = [row for step in range(10) for row in first.rows_of(step, share=False)]
    assert sorted(epoch) == list(range(40))  # an epoch reads every row once
    with pytest.raises(XirangError, match="global_batch 4 there, 8 here"):
        RankBatches(source, global_batch=8, seq=SEQ).load_state_dict(saved)


def test_bad_data_is_refused(tmp_path):
    floats = tmp_path / "floats.npy"
    numpy.save(floats, numpy.zeros(100, dtype=numpy.float32))
    with pytest.raises(XirangError, match="not a flat array of token ids"):
        TokenFile(floats)
    with pytest.raises(XirangError, match="does not exist"):
        TokenFile(tmp_path / "missing.npy")
    small = tmp_path / "small.npy"
    numpy.save(small, numpy.zeros(20, dtype=numpy.int64))
    with pytest.raises(XirangError, match="fewer than one global batch"):
        RankBatches(TokenFile(small), global_batch=4, seq=8)
    with pytest.raises(XirangError, match="does not split evenly"):
        RankBatches(SyntheticTokens(VOCAB), global_batch=5, seq=8, dp=2)


# --- shares train as the global batch ---------------------------------------------------------------------

def build():
    torch.manual_seed(0)
    return build_gpt(GPTConfig(vocab_size=VOCAB, seq_len=64, hidden=32, heads=4, layers=2))


def _rank_main(rank, world, plan, path, steps):
    losses = {}
    for pre_sharded in (True, False):
        example = {"input_ids": torch.zeros(2, SEQ, dtype=torch.long), "labels": torch.zeros(2, SEQ, dtype=torch.long)}
        compiled = xirang.compile(build(), world=world, example_kwargs=example, plan=plan, hardware="cpu")
        optimizer = torch.optim.AdamW(compiled.parameters(), lr=1e-2)
        batches = RankBatches(TokenFile(path), global_batch=GLOBAL_BATCH, seq=SEQ, dp=compiled.dp,
                              dp_rank=compiled.dp_rank, shift_labels=True)
        found = []
        for step in range(steps):
            batch = batches.next_batch() if pre_sharded else batches.batch_at(step, share=False)
            found.append(compiled.train_step(pre_sharded=pre_sharded, **batch).item())
            optimizer.step()
            optimizer.zero_grad()
        losses[pre_sharded] = (found, batches.rows_read)
    return losses


@pytest.mark.matrix
def test_shares_train_as_the_global_batch(tmp_path):
    path = tmp_path / "tokens.npy"
    numpy.save(path, numpy.random.default_rng(0).integers(0, VOCAB, 4000).astype(numpy.int32))
    example = {"input_ids": torch.zeros(2, SEQ, dtype=torch.long), "labels": torch.zeros(2, SEQ, dtype=torch.long)}
    plan = xirang.plan(build(), world=4, example_kwargs=example, global_batch=GLOBAL_BATCH, hardware="cpu",
                       dp=2, tp=1, pp=2, micro_batch=1)
    results = launch(_rank_main, 4, (plan, str(path), 3), timeout_s=600, heartbeat_s=60)
    for rank, result in enumerate(results):
        (shares, share_rows), (whole, whole_rows) = result[True], result[False]
        assert share_rows == 3 * GLOBAL_BATCH // 2 and whole_rows == 3 * GLOBAL_BATCH
        assert max(abs(a - b) for a, b in zip(shares, whole)) <= 1e-6, (rank, shares, whole)
