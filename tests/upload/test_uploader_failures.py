"""The failures an uploader reports per run, read from its debug logs as they grow.

`wandb sync` reports a failed file transfer only in its debug log. Each run's end asks for
the failures so far, so the logs are read from where the last question stopped; these tests
grow a log between questions, the way wandb-core writes it, and check that every failure
is reported once, under its run, whatever the reads' boundaries.
"""

import json

from wbmerge.upload import Credentials, Uploader


def failure_line(run_id: str, name: str) -> str:
    """One debug-log line as wandb-core writes a failed file transfer of `run_id`."""
    return (
        json.dumps(
            {
                "level": "ERROR",
                "msg": "file transfer: upload failed",
                "sync_path": f"/staging/offline-run-x-{run_id}/run-{run_id}.wandb",
                "task": f"DefaultUploadTask{{Path: /x/{name}, Name: {name}, Size: 3}}",
            }
        )
        + "\n"
    )


def make_uploader(tmp_path) -> tuple[Uploader, object]:
    uploader = Uploader(Credentials("http://127.0.0.1:1", "k" * 40), "p", "e", tmp_path)
    logs = tmp_path / "wandb" / "logs"
    logs.mkdir(parents=True)
    return uploader, logs


def test_failures_are_read_once_as_the_log_grows_even_a_line_cut_between_reads(tmp_path):
    uploader, logs = make_uploader(tmp_path)
    log = logs / "debug-sync.1.log"
    first = failure_line("a", "config.yaml")
    second = failure_line("b", "output.log")
    noise = json.dumps({"level": "INFO", "msg": "file transfer: done"}) + "\n"
    log.write_text(noise + first + second[:25])  # the second line is still being written
    assert uploader.file_failures() == {"a": ["file config.yaml not uploaded"]}
    with open(log, "a") as stream:
        stream.write(second[25:])
    assert uploader.file_failures() == {
        "a": ["file config.yaml not uploaded"],
        "b": ["file output.log not uploaded"],
    }
    assert uploader.file_failures() == uploader.file_failures()  # nothing read twice


def test_a_second_log_joins_the_failures_of_its_runs(tmp_path):
    uploader, logs = make_uploader(tmp_path)
    (logs / "debug-sync.1.log").write_text(failure_line("a", "config.yaml"))
    assert uploader.errors() == {"a": ["file config.yaml not uploaded"]}
    (logs / "debug-sync.2.log").write_text(failure_line("a", "requirements.txt"))
    assert uploader.errors() == {
        "a": ["file config.yaml not uploaded", "file requirements.txt not uploaded"]
    }


def test_lines_that_are_not_failures_are_passed_over(tmp_path):
    uploader, logs = make_uploader(tmp_path)
    (logs / "debug-sync.1.log").write_text(
        '"ERROR" not json\n'
        '["ERROR"]\n'
        + "[" * 5000
        + '"ERROR"'
        + "]" * 5000
        + "\n"
        + json.dumps({"level": "ERROR", "msg": "something else"})
        + "\n"
        + failure_line("c", "wandb-metadata.json")
    )
    assert uploader.file_failures() == {"c": ["file wandb-metadata.json not uploaded"]}
