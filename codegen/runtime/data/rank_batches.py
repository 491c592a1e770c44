"""Each data-parallel rank's share of every global batch, read from a tokenised file or made up.

    batches = RankBatches(TokenFile("tokens.npy"), global_batch=64, seq=1024, dp=compiled.dp,
                          dp_rank=compiled.dp_rank)
    for step in range(steps):
        loss = compiled.train_step(pre_sharded=True, **batches.next_batch())
    checkpoint_extra = {"data": batches.state_dict()}   # later: batches.load_state_dict(...)

The data is rows of tokens: a row is ``seq`` tokens (``shift_labels=False``: labels are the inputs,
as Hugging Face causal LMs shift them themselves) or ``seq + 1`` tokens (``shift_labels=True``: inputs
``row[:-1]``, labels ``row[1:]``, for models that take aligned labels such as examples/gpt.py). Global
batch ``s`` is rows ``order[s * B : (s + 1) * B]`` of an order that is a seeded permutation of the rows,
a fresh one per epoch (``shuffle=False``: the file's order). Its dp rank ``d`` takes rows
``[d * B/dp, (d + 1) * B/dp)`` of it (or, given uneven ``shares``, its own run of them): the slice
``train_step`` cuts from the global batch, so ``pre_sharded=True`` with this share trains exactly
as the global batch does.
Every pp and tp rank of one dp index reads the same rows, hence the same micro-batches.

A rank reads only its rows: a ``TokenFile`` is memory-mapped (``numpy.load(mmap_mode="r")`` for
``.npy``, ``torch.load(mmap=True)`` for a saved tensor), so the pages of other ranks' rows are never
touched; ``rows_read`` counts what was read. ``SyntheticTokens`` makes row ``r`` from a generator
seeded by ``(seed, r)``, so every rank and any restart agree without a file.

The position is data: ``state_dict()`` is ``{"step", "seed", "rows", "row_tokens", "global_batch"}``;
``load_state_dict`` continues at that step and refuses a position saved for other data or another
global batch (another dp degree is fine: the global batches do not depend on it).
"""
from __future__ import annotations

from pathlib import Path

import torch

from xirang.ir.errors import XirangError


class TokenFile:
    """A flat array of token ids on disk (``.npy``, or a tensor saved with ``torch.save``), memory-mapped."""

    def __init__(self, path):
        self.path = Path(path)
        if not self.path.is_file():
            raise XirangError(f"token file {str(self.path)!r} does not exist", where=f"--data {self.path}",
                              hint="write the token ids as one flat array: numpy.save('tokens.npy', ids) or "
                                   "torch.save(ids, 'tokens.pt')")
        if self.path.suffix == ".npy":
            import numpy
            self.tokens = numpy.load(self.path, mmap_mode="r")
        else:
            try:
                self.tokens = torch.load(self.path, mmap=True, weights_only=True)
            except Exception as error:  # not a torch zip file, or not a tensor
                raise XirangError(f"{self.path} is neither a .npy file nor a tensor saved with torch.save: {error}",
                                  where=str(self.path), hint="save the token ids with numpy.save (.npy) or "
                                                             "torch.save (a 1-D integer tensor)") from None
        kind = getattr(self.tokens, "dtype", None)
        if getattr(self.tokens, "ndim", None) != 1 or not _is_integer(kind):
            raise XirangError(f"{self.path} holds {type(self.tokens).__name__} of shape "
                              f"{tuple(getattr(self.tokens, 'shape', ()))} and dtype {kind}, not a flat array of "
                              f"token ids", where=str(self.path), hint="flatten the tokenised text into one 1-D "
                                                                     "integer array")

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def read(self, start: int, count: int) -> torch.Tensor:
        piece = self.tokens[start:start + count]
        if not isinstance(piece, torch.Tensor):
            import numpy
            piece = torch.from_numpy(numpy.array(piece, dtype=numpy.int64))
        return piece.to(torch.long)

    def describe(self) -> str:
        return f"{self.path} ({len(self)} tokens)"


class SyntheticTokens:
    """``length`` made-up token ids below ``vocab``; any span reads the same on every rank and restart."""

    BLOCK = 4096  # tokens per seeded block: a span draws only the blocks it touches

    def __init__(self, vocab: int, length: int = 1 << 24, seed: int = 0):
        if vocab < 1 or length < 1:
            raise XirangError(f"SyntheticTokens(vocab={vocab}, length={length}) needs both at least 1",
                              where="SyntheticTokens", hint="pass the model's vocabulary size")
        self.vocab, self.length, self.seed = vocab, length, seed

    def __len__(self) -> int:
        return self.length

    def read(self, start: int, count: int) -> torch.Tensor:
        first, last = start // self.BLOCK, (start + count - 1) // self.BLOCK
        blocks = [torch.randint(0, self.vocab, (self.BLOCK,),
                                generator=torch.Generator().manual_seed(self.seed * 1_000_003 + b))
                  for b in range(first, last + 1)]
        offset = start - first * self.BLOCK
        return torch.cat(blocks)[offset:offset + count]

    def describe(self) -> str:
        return f"synthetic tokens below {self.vocab} (seed {self.seed})"


def _is_integer(dtype) -> bool:
    if isinstance(dtype, torch.dtype):
        return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool
    return getattr(dtype, "kind", None) in ("i", "u")


class RankBatches:
    """This dp rank's share of each global batch of ``source`` (see the module docstring)."""

    def __init__(self, source, *, global_batch: int, seq: int, dp: int = 1, dp_rank: int = 0,
                 shift_labels: bool = False, shuffle: bool = True, seed: int = 0,
                 names=("input_ids", "labels"), shares=None):
        where = f"RankBatches(global_batch={global_batch}, seq={seq}, dp={dp}, dp_rank={dp_rank})"
        if min(global_batch, seq, dp) < 1 or not 0 <= dp_rank < dp:
            raise XirangError("global_batch, seq and dp must be at least 1 and 0 <= dp_rank < dp", where=where,
                              hint="pass compiled.dp and compiled.dp_rank")
        # samples of each dp rank: even by default, or the runtime's uneven ones (CompiledModel.dp_shares)
        self.shares = tuple(shares) if shares is not None else (global_batch // dp,) * dp
        if shares is None and global_batch % dp:
            raise XirangError(f"a global batch of {global_batch} rows does not split evenly over dp={dp}",
                              where=where, hint="use a global batch that is a multiple of the dp degree")
        if len(self.shares) != dp or sum(self.shares) != global_batch or min(self.shares) < 1:
            raise XirangError(f"shares {self.shares} are not {dp} positive sizes summing to {global_batch}",
                              where=where, hint="pass compiled.dp_shares, or no shares for even ones")
        self.source, self.global_batch, self.seq = source, global_batch, seq
        self.dp, self.dp_rank, self.shift_labels, self.shuffle, self.seed = dp, dp_rank, shift_labels, shuffle, seed
        self.names = tuple(names)
        self.row_tokens = seq + 1 if shift_labels else seq
        self.rows = len(source) // self.row_tokens
        if self.rows < global_batch:
            raise XirangError(f"{source.describe()} holds {self.rows} rows of {self.row_tokens} tokens, fewer than "
                              f"one global batch of {global_batch}", where=where,
                              hint="tokenise more text, or lower the global batch or sequence length")
        self.step, self.rows_read = 0, 0
        self._order_epoch, self._order = None, None

    # --- which rows --------------------------------------------------------------------------------

    def _row_order(self, epoch: int) -> torch.Tensor:
        if self._order_epoch != epoch:
            self._order_epoch = epoch
            self._order = (torch.randperm(self.rows, generator=torch.Generator().manual_seed(self.seed * 7919 + epoch))
                           if self.shuffle else torch.arange(self.rows))
        return self._order

    def rows_of(self, step: int, *, share: bool = True) -> list:
        """Row indices of global batch ``step`` (``share``: only this dp rank's slice of it)."""
        per_epoch = self.rows // self.global_batch  # a global batch never straddles two epochs
        epoch, within = divmod(step, per_epoch)
        order = self._row_order(epoch)
        first = within * self.global_batch
        if share:
            size = self.shares[self.dp_rank]
            first += sum(self.shares[:self.dp_rank])
        else:
            size = self.global_batch
        return order[first:first + size].tolist()

    def batch_at(self, step: int, *, share: bool = True) -> dict:
        """The inputs of global batch ``step``: this rank's share, or (``share=False``) the whole batch."""
        rows = torch.stack([self.source.read(r * self.row_tokens, self.row_tokens)
                            for r in self.rows_of(step, share=share)])
        self.rows_read += rows.shape[0]
        inputs, labels = (rows[:, :-1], rows[:, 1:]) if self.shift_labels else (rows, rows)
        return {self.names[0]: inputs.contiguous(), self.names[1]: labels.contiguous()}

    def next_batch(self) -> dict:
        """This rank's share of the next global batch; the position moves on by one step."""
        batch = self.batch_at(self.step)
        self.step += 1
        return batch

    def __iter__(self):
        while True:
            yield self.next_batch()

    # --- the position ------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"step": self.step, "seed": self.seed, "rows": self.rows, "row_tokens": self.row_tokens,
                "global_batch": self.global_batch, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        differ = [k for k in ("seed", "rows", "row_tokens", "global_batch", "shuffle") if state.get(k) != mine[k]]
        if differ:
            found = ", ".join(f"{k} {state.get(k)!r} there, {mine[k]!r} here" for k in differ)
            raise XirangError(f"the data position was saved for other data: {found}",
                              where="RankBatches.load_state_dict",
                              hint="resume with the same data file, sequence length, global batch and seed")
        self.step = int(state["step"])
