"""What a served stream tells control about its KV-cache blocks: the keys (baton.blocks) of
its prompt's and reply's token ids, in the serving engine's block size, so control learns
which blocks its message prefix implies (control/fleet/chainblocks.py). Only hashes leave the
shim, never token ids; only token-path streams carry ids, and only engines that publish KV events
have a block size in the snapshot. A request to a LoRA adapter keys its blocks from the
adapter's root (baton.blocks.root), as control's KV index keys the engine's blocks stored under
it, so they never match the base's or another adapter's."""

# baton: pure

from __future__ import annotations

from baton.blocks import block_keys, root
from baton.model import PrefixBlocks, RequestShape
from dataplane.relay.progress import ChoiceProgress


def prefix_blocks(
    shape: RequestShape,
    block_size: int,
    choice: ChoiceProgress | None,
    adapter: str | None = None,
) -> PrefixBlocks | None:
    """`adapter`: the LoRA adapter the request was served under (None: the base model)."""
    if not block_size or choice is None or not choice.prompt_ids or not shape.prefix_chain:
        return None
    prompt = choice.prompt_ids
    keys = block_keys([*prompt, *choice.token_ids], block_size, root(adapter))
    return PrefixBlocks(shape.prefix_chain[-1], tuple(keys), len(prompt) // block_size, block_size)
