"""``xirang train``'s run inside each rank: the model, its data share, the steps, checkpoints and resume.

``train_rank`` is what every rank runs (xirang_compile/cli/train.py plans once and launches it, or it runs in a
torchrun rank): it builds the factory's model under one seed, compiles it with the plan, reads only its dp share of
each global batch (``RankBatches``: a token file ``--data`` or ``--synthetic`` tokens; the model takes
``input_ids`` and ``labels``), and per step: ``train_step`` on its share, then ``NonFiniteGuard.step``
(codegen/runtime/numerics/nonfinite.py): the global gradient norm (clipped with ``--clip``), the AdamW step
on finite numbers, and on a non-finite loss or norm ``--on-nonfinite``'s policy -- ``stop`` (default) names
the step and the first rank and parameter where it appeared, ``skip`` drops the step, ``rollback`` loads the
newest checkpoint and goes on with the data position where it was (the batches that diverged are not
replayed). Loss spikes are reported on rank 0's log line. Rank 0 logs the loss, tokens per second and the
measured step against the plan's (a live bar on a terminal).

An error inside a rank says which kind it is, so the launcher's summary gives advice that fits: a peer that
died shows as a lost collective (the rank that failed first is the one to read; ``--resume`` continues once
its cause is fixed), an error of the step itself (a bad input, a bug) is named with its rank and step and
is not something ``--resume`` can fix.
"""
from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time

import torch

from xirang.ir.errors import XirangError

MODEL_SEED, ADAM_EPS = 0, 1e-8

def lr_factor(step: int, *, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up over ``warmup`` steps to the peak, then a half cosine down to ``min_ratio`` of it
    at ``total`` (Loshchilov & Hutter 2017, without restarts)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def vocabulary(model) -> int:
    """Token ids below this are valid: the input embedding's rows (Hugging Face's, or the first table)."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embedding is None:
        embedding = next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
    return embedding.num_embeddings


def _batches(args, model, example_kwargs: dict, global_batch: int, compiled):
    """This rank's RankBatches over ``--data`` or synthetic tokens (its dp share of each global batch)."""
    from xirang.codegen.runtime.data.rank_batches import RankBatches, SyntheticTokens, TokenFile
    seq = example_kwargs["input_ids"].shape[1]
    source = TokenFile(args.data) if args.data else SyntheticTokens(vocabulary(model), seed=args.seed)
    # Hugging Face causal LMs shift their labels themselves; the in-repo models take aligned ones
    shift = not hasattr(getattr(model, "config", None), "model_type")
    return RankBatches(source, global_batch=global_batch, seq=seq, dp=compiled.dp, dp_rank=compiled.dp_rank,
                       shift_labels=shift, seed=args.seed, shares=getattr(compiled, "dp_shares", None))


def token_model(args, global_batch: int):
    """The factory's model under the run's seed and real example inputs; refused unless it takes token ids."""
    from xirang.cli.model_files import build, load_factory
    torch.manual_seed(MODEL_SEED)
    model, example_kwargs = build(load_factory(args.model), global_batch, None)
    if set(example_kwargs or {}) != {"input_ids", "labels"} or not any(
            isinstance(m, torch.nn.Embedding) for m in model.modules()):
        raise XirangError(f"xirang train feeds token ids: the model must take input_ids and labels and embed "
                          f"tokens; this factory's inputs are {sorted(example_kwargs or {})}",
                          where=args.model, hint="train other models with xirang run, or your own loop over "
                                                 "xirang.compile")
    example = {name: torch.zeros(tuple(value.shape), dtype=value.dtype) for name, value in example_kwargs.items()}
    return model, example


def train_rank(rank: int, world: int, args, plan, global_batch: int, facts=None) -> dict:
    """One rank's run (see the module docstring); returns the losses (rank 0 prints as it goes). ``facts``
    (rank 0's, train_metrics.RunFacts) when the run writes metrics."""
    import torch.distributed as dist

    import xirang
    from xirang.cli.train_metrics import MetricsWriter, gather_memory, step_began
    from xirang.codegen.runtime.numerics.nonfinite import NonFiniteGuard
    model, example_kwargs = token_model(args, global_batch)
    # the runtime device follows the launcher: NCCL ranks (torchrun on GPUs) on cuda:LOCAL_RANK, gloo on the CPU
    # the plan's own World: a calibrated one (--world-file, the cache) is not a count of preset CPU ranks
    compiled = xirang.compile(model, world=plan.world, example_kwargs=example_kwargs, plan=plan)
    device = compiled.device
    batches = _batches(args, model, example_kwargs, global_batch, compiled)
    optimizer = torch.optim.AdamW(compiled.parameters(), lr=args.lr, eps=ADAM_EPS, weight_decay=args.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(
        step, warmup=args.warmup, total=args.steps, min_ratio=args.min_lr_ratio))
    guard = NonFiniteGuard(getattr(args, "on_nonfinite", None) or "stop", checkpoint_dir=args.checkpoint_dir)
    say = rank == 0
    pids = [None] * world
    if world > 1:
        dist.all_gather_object(pids, os.getpid())
    else:
        pids = [os.getpid()]
    if say:
        print("rank pids: " + " ".join(f"{r}:{pid}" for r, pid in enumerate(pids)), flush=True)
    start, losses = 0, []
    if args.resume:
        start, losses = _resume(compiled, optimizer, schedule, batches, args.checkpoint_dir, say)
    tokens = global_batch * example_kwargs["input_ids"].shape[1]
    predicted = plan.predicted.step_seconds
    bar = TrainProgress(args.steps, start, live=say and sys.stdout.isatty()) if say else None
    step = start
    from xirang.reprice import RepriceAfter
    pins = {k: getattr(args, k) for k in ("tp", "pp", "dp") if getattr(args, k) is not None}
    repricing = RepriceAfter(reprice_step(args), start, compiled, model=model, example_kwargs=example_kwargs,
                             pins=pins, say=say)
    watch = watching(args)
    metrics = MetricsWriter(metrics_path(args), facts, device=device, tensorboard=args.tensorboard,
                            resume_at=start if args.resume else None) if say and watch else None
    stopped = StopOnSigterm(rank, lambda: step)
    try:
        while step < args.steps:
            began = time.perf_counter()
            if watch:
                step_began(device)
            share = {name: value.to(device, non_blocking=True) for name, value in batches.next_batch().items()}
            loss = compiled.train_step(pre_sharded=True, **share)
            outcome = guard.step(compiled, optimizer, loss, step=step + 1, clip=args.clip)
            lr = schedule.get_last_lr()[0]  # the rate this step used
            if outcome.rolled_back_to is not None:  # the checkpoint's step and schedule; the data goes on
                step = outcome.rolled_back_to
                schedule.load_state_dict(outcome.extra["lr"])
                losses = list(outcome.extra["losses"])
                if say:
                    print(f"step {outcome.step}: non-finite ({outcome.found}); rolled back to step {step}, the "
                          f"data position kept at batch {batches.step}", flush=True)
                continue
            if outcome.stepped:
                schedule.step()
            took = time.perf_counter() - began
            losses.append(outcome.loss)
            memory = gather_memory(device, world) if watch else None  # a collective: after the step's clock
            if say:
                bar.line(step, losses[-1], tokens / took, took, predicted, lr, outcome.norm, outcome.stepped)
                if outcome.spike:
                    print(f"warning: {outcome.spike}", flush=True)
            if metrics is not None:
                metrics.record(step=step + 1, loss=losses[-1], lr=lr, step_s=took, grad_norm=outcome.norm,
                               stepped=outcome.stepped, memory=memory, note=outcome.spike)
            repricing.after_step(step + 1)
            step += 1
            every = args.checkpoint_every
            if args.checkpoint_dir and (step == args.steps or (every and step % every == 0)):
                extra = {"data": batches.state_dict(),
                         "lr": schedule.state_dict(), "losses": list(losses)}
                xirang.save_checkpoint(compiled, optimizer, args.checkpoint_dir, step=step, extra=extra)
    except XirangError:
        raise
    except Exception as error:  # noqa: BLE001 - said as what it is, so the launcher's summary advises rightly
        raise step_error(error, rank, step) from error
    finally:
        stopped.restore()
        if metrics is not None:
            metrics.close()
    if bar is not None:
        bar.finish()
    return {"losses": losses, "start": start}


def step_error(error: Exception, rank: int, step: int) -> XirangError:
    """The error a step raised, as the launcher's summary should show it: a lost peer (read the rank that failed
    first, then --resume), or an error of the step itself, which --resume cannot fix."""
    first = str(error).splitlines()[0][:300] if str(error) else type(error).__name__
    where = f"xirang train, rank {rank}, step {step + 1}"
    if _peer_failure(error):
        return XirangError(f"rank {rank} lost a peer in step {step + 1}: {first}", where=where,
                           hint="another rank stopped first: the launcher's or torchrun's summary lists it first, "
                                "with its own error; fix what that says, then rerun the same command with --resume "
                                "to continue from the newest complete checkpoint in --checkpoint-dir")
    return XirangError(f"step {step + 1} failed on rank {rank}: {type(error).__name__}: {first}", where=where,
                       hint="an error of the step itself (the model or its input), not a crash: --resume would "
                            "fail the same way; check the data and the model (xirang train checks the data's "
                            "values against the vocabulary before starting ranks), rerun with --debug for the "
                            "traceback")


def reprice_step(args) -> int:
    """The step after which the plan is re-priced: ``--reprice-after``, else 3 when the run is longer than
    5 steps; 0: never."""
    if args.reprice_after is not None:
        return args.reprice_after
    return 3 if args.steps > 5 else 0


class StopOnSigterm:
    """While installed, SIGTERM raises a XirangError naming the rank and step instead of killing the
    process silently: torchrun stops the surviving ranks with SIGTERM the moment one rank fails, often
    before the survivors' own collectives notice the loss, and they should still say what happened."""

    def __init__(self, rank: int, current_step):
        self.rank, self.current_step, self.previous = rank, current_step, None
        if threading.current_thread() is threading.main_thread():  # signal handlers live on the main thread
            self.previous = signal.signal(signal.SIGTERM, self._stop)

    def _stop(self, signum, frame):
        step = self.current_step() + 1
        raise XirangError(f"rank {self.rank} was stopped by its launcher (SIGTERM) in step {step}",
                          where=f"xirang train, rank {self.rank}, step {step}",
                          hint="torchrun stops every rank once one fails (its summary names the rank that failed "
                               "first): fix what that rank's error says; a crash, not a wrong input, is then "
                               "continued by the same command with --resume from the newest complete checkpoint")

    def restore(self) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)


def _peer_failure(error: Exception) -> bool:
    """Whether a RuntimeError is a collective that lost its peer (torch names these DistError, or gloo's
    transport and NCCL errors say so in their text) rather than a bug of the step itself."""
    import torch.distributed as dist
    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    text = str(error)
    return any(word in text for word in ("gloo", "NCCL", "Connection reset", "Connection closed", "timed out"))


def _resume(compiled, optimizer, schedule, batches, root, say: bool) -> tuple:
    """(first step, losses so far) from the newest complete checkpoint under ``root`` (0, [] if none)."""
    import xirang
    if xirang.latest_checkpoint(root) is None:
        if say:
            print(f"resume: no complete checkpoint in {root}; starting at step 0", flush=True)
        return 0, []
    found = xirang.load_checkpoint(compiled, optimizer, root)
    extra = found["extra"]
    schedule.load_state_dict(extra["lr"])
    batches.load_state_dict(extra["data"])
    if say:
        print(f"resume: step {found['step']} from {xirang.latest_checkpoint(root, quiet=True)}", flush=True)
    return found["step"], list(extra["losses"])


class TrainProgress:
    """Rank 0's log: one line per step, and on a terminal a bar redrawn under it."""

    def __init__(self, total: int, start: int, live: bool):
        self.total, self.start, self.live, self.began = total, start, live, time.perf_counter()

    def line(self, step, loss, tokens_per_s, took, predicted, lr, norm, stepped) -> None:
        clip = "" if norm is None else f"  |grad| {norm:.3g}" + ("" if stepped else " (non-finite: step skipped)")
        text = (f"step {step + 1}/{self.total}  loss {loss:.4f}  lr {lr:.3g}{clip}  {tokens_per_s:,.0f} tok/s  "
                f"step {took * 1e3:.0f} ms (plan {predicted * 1e3:.3g} ms)")
        if self.live:
            sys.stdout.write("\r\033[K")
        print(text, flush=True)
        if self.live:
            done = step + 1
            width = 30
            filled = int(width * done / self.total)
            rate = (done - self.start) / max(1e-9, time.perf_counter() - self.began)
            left = (self.total - done) / rate if rate else 0.0
            sys.stdout.write(f"[{'#' * filled}{'.' * (width - filled)}] {done}/{self.total}  ~{left:.0f} s left")
            sys.stdout.flush()

    def finish(self) -> None:
        if self.live:
            sys.stdout.write("\r\033[K")
            sys.stdout.flush()


def run_folder(args):
    """Where the run's config.toml and metrics.jsonl go: --run-dir, else --checkpoint-dir (None: neither)."""
    return args.run_dir or args.checkpoint_dir


def metrics_path(args):
    from xirang.cli.train_metrics import default_metrics_path
    return args.metrics or default_metrics_path(run_folder(args))


def watching(args) -> bool:
    """Whether the run writes metrics (then every rank hands in its memory and the gradient norm is taken)."""
    return bool(metrics_path(args) or args.tensorboard)
