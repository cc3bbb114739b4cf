"""The plugin's topology rules, as table tests."""

from __future__ import annotations

import pytest

from wbmerge.topology import RankInfo, from_env, label_for


def env(rank, world, local_rank, local_world, group, **extra):
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world),
        "GROUP_RANK": str(group),
        **extra,
    }


@pytest.mark.parametrize(
    "variables, expected_label, multi",
    [
        (env(0, 4, 0, 4, 0), "rank-0", False),
        (env(3, 4, 3, 4, 0), "rank-3", False),
        (env(2, 4, 0, 2, 1), "worker-1-rank-0", True),
        (env(7, 8, 3, 4, 1), "worker-1-rank-3", True),
        (env(5, 16, 1, 2, 2), "worker-2-rank-1", True),
    ],
)
def test_labels_follow_the_plugin(variables, expected_label, multi):
    info = from_env(variables)
    assert info.label == expected_label
    assert info.multi_node is multi


@pytest.mark.parametrize(
    "variables",
    [
        {},
        {"RANK": "0"},
        {"WORLD_SIZE": "4"},
        {"RANK": "0", "WORLD_SIZE": "1"},
        {"RANK": "x", "WORLD_SIZE": "2"},
    ],
)
def test_not_distributed(variables):
    assert from_env(variables) is None


def test_missing_local_variables_mean_one_node():
    info = from_env({"RANK": "3", "WORLD_SIZE": "4"})
    assert (info.local_rank, info.local_world_size, info.worker, info.label) == (3, 4, 0, "rank-3")


def test_job_id_and_restart_from_torch_elastic():
    info = from_env(env(1, 2, 1, 2, 0, TORCHELASTIC_RUN_ID="abc", TORCHELASTIC_RESTART_COUNT="2"))
    assert (info.job_id, info.restart) == ("abc", 2)
    # torchrun's default rendezvous id is the same for every job: not a job id
    assert from_env(env(1, 2, 1, 2, 0, TORCHELASTIC_RUN_ID="none")).job_id is None


def test_inconsistent_environment_is_rejected():
    with pytest.raises(ValueError):
        from_env(env(4, 4, 0, 4, 0))
    with pytest.raises(ValueError):
        from_env(env(1, 4, 3, 2, 0))


def test_metadata_round_trip():
    info = RankInfo(5, 1, 8, 4, 1, restart=2, job_id="job-1")
    block = info.to_metadata()
    assert block["label"] == "worker-1-rank-1" == label_for(5, 1, 1, True)
    assert RankInfo.from_metadata(block) == info
