"""Batched decode over requests that each own a live state: gather one token from each into a single
forward pass, then scatter the results back.

Recurrent layers (conv + SSM / delta-rule state) have a fixed size, so gathering is a concatenation
along the batch dimension. Attention KV differs in length per request: it is left-padded to the
longest, masked out with an attention mask, and every row gets its own position id. After the pass
each request keeps only its own new state (copies, so no request holds a view into the batch).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.nn.functional import pad
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .state import LiveState


def gather(states: Sequence[LiveState], config, device) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
    """A batched cache of `states`, the attention mask for one new token each, and their positions."""
    lengths = [s.position for s in states]
    longest = max(lengths)
    batch = DynamicCache(config=config)
    for li, layer in enumerate(batch.layers):
        rows = [s.cache.layers[li] for s in states]
        if type(layer) is DynamicLayer:
            keys = torch.cat([pad(r.keys, (0, 0, longest - r.keys.shape[-2], 0)) for r in rows])
            values = torch.cat([pad(r.values, (0, 0, longest - r.values.shape[-2], 0)) for r in rows])
            layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys, values
            continue
        for idx in range(layer.number_of_states):
            if rows[0].conv_states[idx] is not None:
                conv = torch.cat([r.conv_states[idx] for r in rows])
                layer.lazy_initialization(conv_states=conv, state_idx=idx)
                layer.conv_states[idx] = conv
            if rows[0].recurrent_states[idx] is not None:
                rec = torch.cat([r.recurrent_states[idx] for r in rows])
                layer.lazy_initialization(recurrent_states=rec, state_idx=idx)
                layer.recurrent_states[idx] = rec
            layer.has_previous_state[idx] = rows[0].has_previous_state[idx]
    mask = torch.zeros(len(states), longest + 1, dtype=torch.long, device=device)
    for i, n in enumerate(lengths):
        mask[i, longest - n :] = 1
    positions = torch.tensor(lengths, dtype=torch.long, device=device).view(-1, 1)
    return batch, mask, positions


def scatter(batch: DynamicCache, states: Sequence[LiveState], tokens: Sequence[int]) -> None:
    """Give every request its row of the batched state after one token."""
    for li, layer in enumerate(batch.layers):
        for i, state in enumerate(states):
            own = state.cache.layers[li]
            if type(layer) is DynamicLayer:
                own.keys = torch.cat([own.keys, layer.keys[i : i + 1, :, -1:, :]], dim=-2)
                own.values = torch.cat([own.values, layer.values[i : i + 1, :, -1:, :]], dim=-2)
                continue
            for idx in range(layer.number_of_states):
                if layer.conv_states[idx] is not None:
                    own.conv_states[idx] = layer.conv_states[idx][i : i + 1].clone()
                if layer.recurrent_states[idx] is not None:
                    own.recurrent_states[idx] = layer.recurrent_states[idx][i : i + 1].clone()
    for state, token in zip(states, tokens):
        state.tokens.append(int(token))
