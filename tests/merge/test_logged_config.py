"""The config entries wandb writes about what a rank logged (`loggedconfig`): read from
either way the SDK writes them, taken out of the primary's records, and relabelled to the
keys a shared run gives the rank."""

from __future__ import annotations

import json

import pytest
from wandb.proto import wandb_internal_pb2 as pb

from wbmerge.errors import WbmergeError
from wbmerge.merge.loggedconfig import labelled_entries, without_logged_entries
from wbmerge.wandbcore import fold_logged_entries

CHART = {
    "panel_type": "Vega2",
    "panel_config": {
        "panelDefId": "wandb/line/v0",
        "userQuery": {
            "queryFields": [
                {
                    "name": "runSets",
                    "fields": [
                        {
                            "name": "summaryTable",
                            "args": [{"name": "tableKey", "value": "val_curve_table"}],
                        }
                    ],
                }
            ]
        },
    },
}
BOXES = {
    "type": "bounding_box/class_labels",
    "key": "img_wandb_delimeter_pred",
    "value": {"0": "cat"},
}


def config_record(*items: tuple[list[str], object]) -> pb.ConfigRecord:
    record = pb.ConfigRecord()
    for path, value in items:
        item = record.update.add()
        if len(path) == 1:
            item.key = path[0]
        else:
            item.nested_key.extend(path)
        item.value_json = json.dumps(value)
    return record


def test_entries_are_read_by_their_path_and_from_a_whole_wandb_block():
    entries = {}
    fold_logged_entries(entries, config_record((["_wandb", "visualize", "val_curve"], CHART)))
    block = {"cli_version": "0.31.0", "bounding_box/class_labels": {BOXES["key"]: BOXES}}
    fold_logged_entries(entries, config_record((["_wandb"], block), (["lr"], 0.1)))
    assert {key: json.loads(value) for key, value in entries.items()} == {
        ("visualize", "val_curve"): CHART,
        ("bounding_box/class_labels", "img_wandb_delimeter_pred"): BOXES,
    }


def test_the_primarys_records_lose_the_entries_and_keep_the_rest():
    block = {"cli_version": "0.31.0", "mask/class_labels": {"m_wandb_delimeter_s": {}}}
    record = config_record(
        (["_wandb", "visualize", "val_curve"], CHART), (["_wandb"], block), (["lr"], 0.1)
    )
    assert without_logged_entries(record)
    assert [(item.key, json.loads(item.value_json)) for item in record.update] == [
        ("_wandb", {"cli_version": "0.31.0"}),
        ("lr", 0.1),
    ]
    assert not without_logged_entries(config_record((["lr"], 0.1)))


def relabelled(entries: dict, logged: set[str], keeps=lambda key: True) -> dict:
    entries = {key: json.dumps(value) for key, value in entries.items()}
    found = labelled_entries(entries, "worker-1-rank-3", "{key}/{label}", logged, keeps)
    return {key: json.loads(value) for key, value in found}


def test_each_entry_names_the_ranks_labelled_keys():
    got = relabelled(
        {
            ("visualize", "val_curve"): CHART,
            ("viz", "tbl"): {"id": "x", "historyFieldSettings": {"x-axis": "_step", "key": "tbl"}},
            ("bounding_box/class_labels", "img_wandb_delimeter_pred"): BOXES,
        },
        {"val_curve_table", "tbl", "img"},
    )
    chart = got[("visualize", "val_curve/worker-1-rank-3")]
    [field] = chart["panel_config"]["userQuery"]["queryFields"][0]["fields"]
    assert field["args"] == [{"name": "tableKey", "value": "val_curve_table/worker-1-rank-3"}]
    assert (
        got[("viz", "tbl/worker-1-rank-3")]["historyFieldSettings"]["key"] == "tbl/worker-1-rank-3"
    )
    boxes = got[("bounding_box/class_labels", "img/worker-1-rank-3_wandb_delimeter_pred")]
    assert boxes == {**BOXES, "key": "img/worker-1-rank-3_wandb_delimeter_pred"}


def test_a_key_longer_than_the_one_logged_is_labelled_in_its_logged_part():
    # (an EvalTable's class names are keyed by the table's key, then source and column)
    key = "preds/predictions/image_wandb_delimeter_boxes"
    got = relabelled({("bounding_box/class_labels", key): BOXES}, {"preds", "pred"})
    assert list(got) == [
        (
            "bounding_box/class_labels",
            "preds/worker-1-rank-3/predictions/image_wandb_delimeter_boxes",
        )
    ]


def test_an_entry_whose_key_is_not_kept_per_rank_is_left_out():
    entries = {
        ("visualize", "val_curve"): CHART,
        ("bounding_box/class_labels", "img_wandb_delimeter_pred"): BOXES,
    }
    got = relabelled(entries, {"val_curve_table", "img"}, keeps=lambda key: key == "img")
    assert list(got) == [("bounding_box/class_labels", "img/worker-1-rank-3_wandb_delimeter_pred")]


@pytest.mark.parametrize("depth", [10, 5000])
def test_an_entry_that_cannot_be_read_is_refused_in_one_line(depth):
    deep = "[" * depth + "]" * depth if depth > 100 else '{"tableKey": '
    entries = {("visualize", "val_curve"): deep}
    with pytest.raises(WbmergeError, match=r"^rank-1: its config entry _wandb\.visualize\."):
        labelled_entries(entries, "rank-1", "{key}/{label}", set(), lambda key: True)
