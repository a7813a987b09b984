"""NGFL's task alignment table and label-aligned head fusion (issue 17, groundwork): coverage,
alignment by label whatever the row order or table version, partial / total / literal fusion,
pending rows under pre-alignment, and hostile tables rejected before anything changes."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from methods.ngfl.fusion import HeadUpload, fuse_heads
from methods.ngfl.table import DeviceTable, GlobalTable, TableError, UploadTable, coverage

D = 3


def upload(client: str, labels, current, viewed=None, values=None, version=0) -> HeadUpload:
    viewed = labels if viewed is None else viewed
    rows = len(labels)
    w = np.array(values if values is not None else [[float(i + 1)] * D for i in range(rows)], np.float32)
    t = UploadTable(tuple(labels), tuple(current), tuple(viewed), version)
    return HeadUpload(client, t, w.reshape(rows, D), w[:, 0].copy())


@pytest.mark.parametrize(
    "task, known, expected",
    [
        (["1", "2"], ["0", "1", "2"], "full"),
        (["1", "2"], ["1", "2"], "full"),  # equal is full (notes G6)
        (["2", "3"], ["0", "1", "2"], "semi"),
        (["3", "4"], ["0", "1"], "none"),
        (["3"], [], "none"),
    ],
)
def test_coverage_of_hand_made_tables(task, known, expected) -> None:
    assert coverage(task, known) == expected


def test_two_devices_adding_the_same_class_end_in_one_row() -> None:
    table = GlobalTable(["0", "1"], [(0, "a"), (0, "a")], version=1)
    head, bias = np.ones((2, D), np.float32), np.ones(2, np.float32)
    ups = [
        upload("b", ["0", "1", "5"], ["5"], values=[[1] * D, [1] * D, [4] * D]),
        upload("a", ["5", "0", "1"], ["5"], values=[[2] * D, [1] * D, [1] * D]),
    ]
    w, b = fuse_heads(table, head, bias, ups, rnd=3)
    assert table.labels == ["0", "1", "5"] and table.added[2] == (3, "a") and table.version == 2
    np.testing.assert_allclose(w[2], [3.0] * D)  # one row: the mean of the two devices' rows, found by label
    np.testing.assert_allclose(b[2], 3.0)


def test_partial_fusion_keeps_a_row_nobody_trained_and_total_averages_the_viewers() -> None:
    table = GlobalTable(["0", "1", "2"], [(0, "a")] * 3)
    head, bias = np.full((3, D), 7.0, np.float32), np.full(3, 7.0, np.float32)
    ups = [
        upload("a", ["0", "1", "2"], ["2"], viewed=["0", "2"], values=[[1] * D, [2] * D, [3] * D]),
        upload("b", ["0", "1", "2"], ["2"], viewed=["0", "1", "2"], values=[[5] * D, [6] * D, [5] * D]),
    ]
    w, _ = fuse_heads(copy.deepcopy(table), head, bias, ups, rnd=1, mode="partial")
    np.testing.assert_allclose(w[:, 0], [7.0, 7.0, 4.0])  # rows 0, 1 untrained this round: kept
    w, _ = fuse_heads(copy.deepcopy(table), head, bias, ups, rnd=1, mode="total")
    np.testing.assert_allclose(w[:, 0], [3.0, 6.0, 4.0])  # row 1: only b has viewed class "1"


def test_literal_eq10_shrinks_rows_and_wipes_untrained_ones() -> None:
    table = GlobalTable(["0", "1"], [(0, "a")] * 2)
    head, bias = np.full((2, D), 7.0, np.float32), np.full(2, 7.0, np.float32)
    ups = [upload("a", ["0", "1"], ["1"], values=[[1] * D, [4] * D]), upload("b", ["0", "1"], ["0"])]
    w, _ = fuse_heads(table, head, bias, ups, rnd=1, mode="partial", literal=True)
    np.testing.assert_allclose(w[:, 0], [0.5, 2.0])  # each row held by 1 of 2 senders: half its value


def test_a_stale_table_still_aligns_by_label() -> None:
    table = GlobalTable(["0", "1", "2", "3"], [(0, "a")] * 4, version=5)
    head, bias = np.zeros((4, D), np.float32), np.zeros(4, np.float32)
    stale = upload("a", ["3", "1"], ["3", "1"], values=[[3] * D, [1] * D], version=2)  # rows in its own order
    w, _ = fuse_heads(table, head, bias, [stale], rnd=6)
    np.testing.assert_allclose(w[:, 0], [0.0, 1.0, 0.0, 3.0])


def test_a_device_adopts_the_global_order_and_keeps_its_local_classes() -> None:
    dev = DeviceTable("a")
    assert dev.start_task(["0", "1"], rnd=0) == ("none", ["0", "1"])
    dev.start_task(["7"], rnd=2)  # not yet at the aggregator
    table = GlobalTable(["1", "0", "4"], [(0, "b"), (0, "a"), (1, "b")], version=3)
    mapping = dev.adopt(table)
    assert dev.labels == ["1", "0", "4", "7"] and mapping == [1, 0, None, 2] and dev.base_version == 3
    assert dev.start_task(["4", "5"], rnd=4) == ("semi", ["5"])
    assert dev.start_task(["0", "4"], rnd=5) == ("full", [])
    sent, rows = dev.upload(partial=True)
    assert sent.labels == ("0", "4") and rows == [1, 2] and sent.current == ("0", "4")
    sent, rows = dev.upload(partial=False)
    assert sent.labels == tuple(dev.labels) and rows == list(range(5))
    assert dev.history == [["0", "1"], ["7"], ["4", "5"], ["0", "4"]]  # kept on the device only
    assert "history" not in sent.to_meta()


def test_pre_alignment_rows_stay_pending_until_first_fused() -> None:
    table = GlobalTable(["0"], [(0, "a")])
    table.extend(["3", "2"], rnd=1, by="b", pending=True)
    assert table.labels == ["0", "2", "3"] and table.pending == {"2", "3"}
    head, bias = np.zeros((3, D), np.float32), np.zeros(3, np.float32)
    fuse_heads(table, head, bias, [upload("b", ["2"], ["2"])], rnd=1)
    assert table.pending == {"3"}
    again = GlobalTable.from_meta(table.to_meta())
    assert again.labels == table.labels and again.pending == {"3"} and again.version == table.version


HOSTILE = [
    ("duplicate labels", {"labels": ["1", "1"], "current": ["1"], "viewed": ["1"], "base_version": 0}, 2),
    ("rows differ from the head", {"labels": ["1", "2"], "current": ["1"], "viewed": ["1"], "base_version": 0}, 3),
    ("current outside labels", {"labels": ["1"], "current": ["9"], "viewed": ["9"], "base_version": 0}, 1),
    (
        "10,000 labels",
        {"labels": [str(i) for i in range(10_000)], "current": [], "viewed": [], "base_version": 0},
        10_000,
    ),
    ("non-string labels", {"labels": [1, 2], "current": [], "viewed": [], "base_version": 0}, 2),
    ("unprintable label", {"labels": ["a\x00"], "current": [], "viewed": [], "base_version": 0}, 1),
    ("negative version", {"labels": ["1"], "current": ["1"], "viewed": ["1"], "base_version": -1}, 1),
    ("not an object", ["1"], 1),
]


@pytest.mark.parametrize("why, meta, rows", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_tables_are_rejected_before_anything_changes(why, meta, rows) -> None:
    table = GlobalTable(["0", "1"], [(0, "a")] * 2, version=4)
    before = table.to_meta()
    with pytest.raises(TableError) as info:
        UploadTable.parse(meta, rows)
    assert info.value.reason == "table"
    assert table.to_meta() == before


def test_an_upload_round_trips_through_json_metadata() -> None:
    t = UploadTable(("0", "5"), ("5",), ("0", "5"), 3)
    assert UploadTable.parse(t.to_meta(), 2) == t
    with pytest.raises(TableError, match="2 labels for weight"):
        HeadUpload("a", t, np.zeros((3, D), np.float32), np.zeros(3, np.float32))
