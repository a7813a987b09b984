"""NGFL's growing head and its two losses (issue 17, groundwork)."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from methods.ngfl.model import Extractor, GrowingHead, self_attention, total_attention
from methods.ngfl.table import DeviceTable, GlobalTable


def test_the_head_follows_the_table_and_new_rows_start_at_zero() -> None:
    dev = DeviceTable("a")
    dev.start_task(["0", "1"], rnd=0)
    head = GrowingHead(4, rows=2)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[0.0] * 4, [1.0] * 4]))
        head.bias.copy_(torch.tensor([0.0, 1.0]))
    mapping = dev.adopt(GlobalTable(["1", "2", "0"], [(0, "b")] * 3, version=1))
    head.reindex(mapping)
    assert dev.labels == ["1", "2", "0"]
    torch.testing.assert_close(head.bias.detach(), torch.tensor([1.0, 0.0, 0.0]))
    torch.testing.assert_close(head.weight.detach()[0], torch.ones(4))
    head.grow(2)
    assert head.rows == 5 and float(head.weight.detach()[3:].abs().sum()) == 0.0
    with pytest.raises(ValueError, match="no row 9"):
        head.reindex([9])


def test_self_attention_uses_the_current_rows_chosen_by_the_table() -> None:
    logits = torch.tensor([[2.0, 0.5, 3.0, -1.0]])
    y = torch.tensor([2])  # row 2 is a current class; current rows are 0 and 2, not the last rows
    expected = F.cross_entropy(torch.tensor([[2.0, 3.0]]), torch.tensor([1]))
    torch.testing.assert_close(self_attention(logits, y, [0, 2]), expected)
    torch.testing.assert_close(total_attention(logits, y), F.cross_entropy(logits, y))
    usable = torch.tensor([True, False, True, True])  # a pending row held by others is out of the softmax
    torch.testing.assert_close(
        total_attention(logits, y, usable), F.cross_entropy(torch.tensor([[2.0, 3.0, -1.0]]), torch.tensor([1]))
    )
    with pytest.raises(ValueError, match="outside"):
        self_attention(logits, torch.tensor([1]), [0, 2])


def test_the_extractor_gives_features_of_its_last_width() -> None:
    net = Extractor(784)
    assert net(torch.zeros(3, 784)).shape == (3, 128) and net.dim == 128
