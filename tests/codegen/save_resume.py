"""A checkpoint round trip across meshes, run in each rank: the tests of context and expert parallelism
save under one plan and resume under another (another cp, another ep)."""
from __future__ import annotations

import torch


def save_then_resume(world, built, batch, save_plan, load_plan, directory) -> tuple:
    """In a rank: train one step under ``save_plan``, checkpoint, train one more; load the checkpoint
    under ``load_plan`` (another mesh) and train that second step again. Returns the step loaded and
    both full state dicts, which must be equal. ``built()`` gives (model, example inputs), ``batch(step)``
    the step's inputs."""
    import xirang

    def compiled(plan):
        model, inputs = built()
        made = xirang.compile(model, world=world, example_kwargs=inputs, plan=plan)
        return made, torch.optim.AdamW(made.parameters(), lr=1e-3, eps=1e-3)
    first, optimizer = compiled(save_plan)
    for step in range(2):
        if step == 1:
            xirang.save_checkpoint(first, optimizer, directory, step=1)
        first.train_step(**batch(step))
        optimizer.step()
        optimizer.zero_grad()
    second, optimizer = compiled(load_plan)
    loaded_at = xirang.load_checkpoint(second, optimizer, directory)["step"]
    second.train_step(**batch(1))
    optimizer.step()
    return loaded_at, first.full_state_dict(), second.full_state_dict()
