"""Pipeline stages of the GPT of workloads/chargpt.py, as torchtitan cuts its models: every stage is the whole
model with the other stages' parts removed, so each parameter keeps its name (``blocks.3.attn.q.weight`` on
whichever stage holds block 3) and a checkpoint of the stages is a checkpoint of the model.

Stage 0 holds the embeddings, the last stage the final LayerNorm and the lm head, and the blocks are split in
order, as evenly as they go (the first stages take one more where they do not divide). A head tied to the
embedding cannot be on two stages: build the GPT with ``tie_embeddings=False``.

Example (4 layers, 2 stages)::

    stage = split_gpt(model, stage=1, num_stages=2)   # blocks 2 and 3, ln_f, lm_head; forward(hidden) -> logits
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from raylastic.workloads.chargpt import GPT


def stage_blocks(num_blocks: int, stage: int, num_stages: int) -> range:
    """The blocks of ``stage`` of ``num_stages``: consecutive, the first ``num_blocks % num_stages`` stages one
    more."""
    if not 0 <= stage < num_stages <= num_blocks:
        raise ValueError(f"stage {stage} of {num_stages} over {num_blocks} blocks: every stage needs a block "
                         f"(workload.options.n_layer >= the pipeline's stages)")
    size, extra = divmod(num_blocks, num_stages)
    start = stage * size + min(stage, extra)
    return range(start, start + size + (stage < extra))


def split_gpt(model: GPT, stage: int, num_stages: int) -> GPT:
    """``model`` cut in place down to ``stage`` of ``num_stages``; returns it."""
    if model.lm_head.weight is model.wte.weight and num_stages > 1:
        raise ValueError("the GPT's lm head is tied to its token embedding, which a pipeline puts on two stages: "
                         "set workload.options.tie_embeddings=false for parallel.pp > 1")
    kept = {str(index) for index in stage_blocks(len(model.blocks), stage, num_stages)}
    for key in [key for key in model.blocks if key not in kept]:
        del model.blocks[key]
    if stage > 0:
        model.wte = model.wpe = model.drop = None
    if stage < num_stages - 1:
        model.ln_f = model.lm_head = None
    return model
