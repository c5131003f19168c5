"""Position detectors: the rope, position-id and KV-cache contract probes on hand-broken functions."""

import torch

from faultbench.detectors.position import (
    apply_rope_problem,
    kv_cache_problem,
    positions_problem,
    rope_at_problem,
    tables_problem,
)
from faultbench.model.gpt import KVCache
from faultbench.model.rope import apply_rope, position_ids_from_mask, rope_at, rope_tables

CPU = torch.device("cpu")


def test_reference_keeps_the_contracts():
    assert tables_problem(rope_tables, 16, 64, 10000.0) is None
    assert rope_at_problem(rope_at, 16, CPU) is None
    assert apply_rope_problem(apply_rope, 16, CPU) is None
    assert positions_problem(position_ids_from_mask, CPU) is None
    assert kv_cache_problem(KVCache, CPU) is None


def test_tables_one_short():
    def short(head_dim, max_positions, base):
        return rope_tables(head_dim, max_positions - 1, base)

    assert "shape" in tables_problem(short, 16, 64, 10000.0)


def test_rotation_sign_slip_is_not_a_rotation():
    def sign_slip(x, cos, sin):
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos - x1 * sin), dim=-1).to(x.dtype)

    assert "rotation" in apply_rope_problem(sign_slip, 16, CPU)


def test_positions_offset_by_cache_length():
    def drift(attention_mask, past_len=0):
        return (attention_mask[:, past_len:].long().cumsum(-1) - 1 + past_len).clamp_(min=0)

    assert "past_len" in positions_problem(drift, CPU)


def test_kv_cache_written_one_slot_late():
    class Shifted(KVCache):
        def update(self, layer, k, v):
            start = self.lengths[layer]
            end = start + k.shape[2]
            if self.keys[layer] is None:
                self.keys[layer] = k.new_zeros(*k.shape[:2], self.max_len + 1, k.shape[3])
                self.values[layer] = v.new_zeros(*v.shape[:2], self.max_len + 1, v.shape[3])
            self.keys[layer][:, :, start + 1:end + 1] = k
            self.values[layer][:, :, start + 1:end + 1] = v
            self.lengths[layer] = end
            return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    assert kv_cache_problem(Shifted, CPU) is not None
