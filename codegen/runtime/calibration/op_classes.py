"""Microbenchmarks of the op classes the roofline prices apart from matmuls (``xirang calibrate``):
the non-matmul FLOPs of a transformer (each kind apart: gelu, layer norm, softmax, cross-entropy) and
fused attention, each forward and backward, with the FLOPs the analysis counts for them
(``passes/analysis/flops.py``), so the fitted rates (``Efficiency.other`` and each kind's
``Calibration.other_kind_efficiency``, ``Efficiency.attention``) and fixed costs
(``Calibration.op_fixed_s``) price those ops as the planner sees them. ``codegen/runtime/calibration/calibrate.py``
runs them with its timer (``timed``: single calls, on rank 0 alone where ranks share cores) and
``calibrated_world`` fits them.
"""
from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from xirang.codegen.runtime.executor.split_backward import backward_input, backward_weights
from xirang.ir.calibration import OTHER_KINDS
from xirang.passes.analysis.flops import PER_ELEMENT

# (rows, width) of the timed non-matmul ops: micro-batch x seq rows of a hidden or MLP-wide activation,
# or of logits, up to 8 M elements (32 MB: on the development box log-softmax ran 2.0 ns an element
# up to 2 M elements, 3.3 at 4 M and 4.4 at 8 M, as the tensors outgrow its caches)
OTHER_SHAPES = ((128, 256), (256, 256), (512, 1024), (1024, 1024), (256, 2048), (2048, 1024), (2048, 2048),
                (2048, 4096))
QUICK_OTHER_SHAPES = ((64, 128), (128, 256))
# (batch, heads, seq, head dim) of the timed fused attention, causal as decoders train: at least two
# sizes at each sequence length, since the CPU kernel's rate per counted FLOP grows with it (its blocks,
# and the masked ones it skips): alone on one core of the development box 41-61 GFLOP/s at seq 128,
# 53-78 at 256, 68-85 at 512, head dims 32 and 64 alike within that; one line through seq 128 to 512
# priced tp8's attention (seq 128) 35% fast
ATTENTION_SHAPES = ((1, 8, 128, 32), (2, 8, 128, 32), (4, 8, 128, 32), (1, 8, 256, 32), (2, 4, 256, 64),
                    (1, 4, 512, 32), (1, 8, 512, 64))
QUICK_ATTENTION_SHAPES = ((1, 2, 64, 32), (1, 2, 128, 32))


def other_samples(device: str, quick: bool, timed, iters: int) -> dict:
    """{kind: [[FLOPs, seconds], ...]} of a transformer's non-matmul op kinds (``OTHER_KINDS``: gelu,
    layer norm, log-softmax for the softmax kind, cross-entropy over logits of that width), each alone
    forward and backward at each (rows, width), FLOPs as the analysis counts them (``PER_ELEMENT``,
    backward ≈ forward), so each kind's line prices its ops as the planner sees them. Timed apart
    because their rates differ: on one core of the development box gelu ran 2.9 ns an element forward
    and backward, a layer norm 2.2 ns at 1.4x gelu's counted FLOPs. ``timed`` is the caller's
    (``calibrate.py`` passes one that leaves the inputs out of cache before each call)."""
    samples = {kind: [] for kind in OTHER_KINDS}
    for rows, width in (QUICK_OTHER_SHAPES if quick else OTHER_SHAPES):
        for kind, (forward, output_grad, leaves) in _kind_calls(device, rows, width).items():
            def forward_and_backward(forward=forward, output_grad=output_grad, leaves=leaves):
                for leaf in leaves:  # each gradient stored afresh, as in a step's first micro-batch
                    leaf.grad = None
                torch.autograd.backward([forward()], [output_grad])
            flops = 2.0 * PER_ELEMENT[kind] * rows * width
            samples[kind].append([flops, timed(forward_and_backward, device, iters)])
    return samples


# inputs each kind's call below gives gradients to (its leaves): ``calibrated_world`` takes that many
# autograd nodes and gradient ops out of the kind's fixed cost (Calibration.backward_op_overhead_s prices them)
KIND_GRADIENTS = {"gelu": 1, "layer_norm": 3, "softmax": 1, "cross_entropy": 1}


def _kind_calls(device: str, rows: int, width: int) -> dict:
    """{kind: (forward call, its output's gradient, the leaves it gives gradients to)} at (rows, width),
    each op called as the emitted program calls it (``torch.ops.aten``)."""
    aten = torch.ops.aten
    x = torch.randn(rows, width, device=device, requires_grad=True)
    weight = torch.ones(width, device=device, requires_grad=True)
    bias = torch.zeros(width, device=device, requires_grad=True)
    grad = torch.randn(rows, width, device=device)
    labels = torch.randint(0, width, (rows,), device=device)
    return {"gelu": (lambda: aten.gelu.default(x), grad, (x,)),
            "layer_norm": (lambda: aten.native_layer_norm.default(x, [width], weight, bias, 1e-5)[0], grad,
                           (x, weight, bias)),
            "softmax": (lambda: aten._log_softmax.default(x, -1, False), grad, (x,)),
            "cross_entropy": (lambda: aten.cross_entropy_loss.default(x, labels), torch.ones((), device=device), (x,))}


def attention_samples(device: str, quick: bool, timed, iters: int) -> list:
    """[FLOPs, seconds, seq] of fused causal attention forward and backward at each (batch, heads, seq,
    head dim): FLOPs as the analysis counts them (QKᵀ and AV in full, 4·B·H·s²·d, backward twice)."""
    samples = []
    for batch, heads, seq, dim in (QUICK_ATTENTION_SHAPES if quick else ATTENTION_SHAPES):
        q, k, v = (torch.randn(batch, heads, seq, dim, device=device, requires_grad=True) for _ in range(3))
        grad = torch.randn(batch, heads, seq, dim, device=device)

        def forward_and_backward(q=q, k=k, v=v, grad=grad):
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)
        samples.append([3 * 4.0 * batch * heads * seq * seq * dim, timed(forward_and_backward, device, iters), seq])
    return samples


# (rows, hidden, blocks) of the recompute sample: few rows, so the checkpoint's own cost is not lost
# in the FLOPs' noise
RECOMPUTE_SHAPE, QUICK_RECOMPUTE_SHAPE = (16, 256, 4), (4, 64, 2)


def recompute_sample(device: str, quick: bool, timed, iters: int) -> dict:
    """Seconds of a stack of transformer-like blocks (layer norm, linear, gelu, linear, residual add)
    forward and backward plain, with every block under ``torch.utils.checkpoint`` (non-reentrant, as
    the emitted program's recompute regions run: passes/lowering/regions.py), and forward alone
    with autograd recording (what the recompute runs again); and the tensors the plain forward saves
    for the backward. ``calibrated_world`` prices a recomputed region's extra cost per saved tensor
    from these: (checkpointed - plain - forward) / saved."""
    from torch.utils.checkpoint import checkpoint

    rows, hidden, blocks = QUICK_RECOMPUTE_SHAPE if quick else RECOMPUTE_SHAPE
    weights = [(torch.randn(4 * hidden, hidden, device=device, requires_grad=True),
                torch.randn(hidden, 4 * hidden, device=device, requires_grad=True)) for _ in range(blocks)]
    x = torch.randn(rows, hidden, device=device, requires_grad=True)

    def block(h, up, down):
        return h + F.linear(F.gelu(F.linear(F.layer_norm(h, (hidden,)), up)), down)

    def forward(checkpointed: bool):
        h = x
        for up, down in weights:
            h = checkpoint(block, h, up, down, use_reentrant=False) if checkpointed else block(h, up, down)
        return h

    def step(checkpointed: bool):
        for up, down in weights:  # a fresh gradient each time, as after optimizer.zero_grad
            up.grad = down.grad = None
        x.grad = None
        forward(checkpointed).sum().backward()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(1) or t, lambda t: t):
        forward(False)
    return {"plain_s": timed(lambda: step(False), device, iters),
            "checkpointed_s": timed(lambda: step(True), device, iters),
            "forward_s": timed(lambda: forward(False), device, iters), "saved_tensors": len(saved)}


# (batch, seq, hidden, heads, blocks) of the split-backward sample: a pipeline stage of GPT blocks at
# the rows CPU pipelines train at (micro-batch 2, seq 128), where the split's cost is what it is there
SPLIT_SHAPE, QUICK_SPLIT_SHAPE = (2, 128, 256, 8, 2), (1, 64, 128, 4, 1)
SPLIT_ROUNDS = 3


def split_backward_sample(device: str, quick: bool, timed, iters: int) -> dict:
    """Seconds of a middle pipeline stage of pre-LN transformer blocks (layer norm, fused QKV, causal
    attention, projection, layer norm, GELU MLP, residuals) forward alone, forward and fused backward
    (``Backward``), and forward and split backward (``BackwardInput`` then ``BackwardWeight``), each
    backward run as ``codegen/runtime/executor/pipeline_executor.py`` runs it: from a received output gradient,
    to the stage input and the weights. ``calibrated_world`` prices the split's extra cost as a
    fraction of the fused backward from these: (split - fused) / (fused - forward)."""
    batch, seq, hidden, heads, blocks = QUICK_SPLIT_SHAPE if quick else SPLIT_SHAPE
    shapes = [(3 * hidden, hidden), (3 * hidden,), (hidden, hidden), (hidden,), (4 * hidden, hidden),
              (4 * hidden,), (hidden, 4 * hidden), (hidden,), (hidden,), (hidden,), (hidden,), (hidden,)]
    weights = [torch.randn(*shape, device=device).mul_(0.02).requires_grad_() for _ in range(blocks)
               for shape in shapes]
    received = torch.randn(batch, seq, hidden, device=device)  # the next stage's gradient

    def block(h, qkv, qkv_bias, proj, proj_bias, up, up_bias, down, down_bias, ln1, ln1_bias, ln2, ln2_bias):
        q, k, v = (t.view(batch, seq, heads, hidden // heads).transpose(1, 2)
                   for t in F.linear(F.layer_norm(h, (hidden,), ln1, ln1_bias), qkv, qkv_bias).split(hidden, -1))
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(h.shape)
        h = h + F.linear(attention, proj, proj_bias)
        return h + F.linear(F.gelu(F.linear(F.layer_norm(h, (hidden,), ln2, ln2_bias), up, up_bias)), down, down_bias)

    def forward():
        leaf = torch.randn(batch, seq, hidden, device=device).requires_grad_()  # the received activation
        h = leaf
        for b in range(blocks):
            h = block(h, *weights[b * len(shapes):(b + 1) * len(shapes)])
        return leaf, h

    def fresh():  # a step's first micro-batch stores its gradients afresh
        for weight in weights:
            weight.grad = None

    def fused():
        fresh()
        _, out = forward()
        torch.autograd.backward([out], [received])

    def split():
        fresh()
        leaf, out = forward()
        _, groups = backward_input([out], [received.clone()], [leaf], weights)
        backward_weights(groups, weights)
    # the split's extra is a few ms on 10-20: rounds that alternate the three, so a drift in the
    # machine's load falls on each alike, and the median round of each
    rounds = [[timed(fn, device, iters) for fn in (forward, fused, split)] for _ in range(SPLIT_ROUNDS)]
    forward_s, fused_s, split_s = (statistics.median(column) for column in zip(*rounds))
    return {"forward_s": forward_s, "fused_s": fused_s, "split_s": split_s,
            "shape": [batch, seq, hidden, heads, blocks]}
