"""wbmerge loads wandb's protobuf classes without importing the wandb SDK, and leaves a later
`import wandb` in the same process working as usual."""

import subprocess
import sys


def run(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_the_cli_does_not_import_the_wandb_sdk():
    out = run(
        "import sys, wbmerge.cli, wbmerge.analyse.parquet, wbmerge.analyse.skew\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'wandb'))"
    )
    assert out == "[]"


def test_a_pass_through_sync_does_not_import_pyarrow():
    # pyarrow is 85 ms of a start; only the shared merge, export and report use it.
    out = run(
        "import sys, wbmerge.cli, wbmerge.api, wbmerge.sync.pipeline, wbmerge.sync, wbmerge.verify, wbmerge.upload\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'pyarrow', 'wandb'}))"
    )
    assert out == "[]"


def test_wandb_imported_afterwards_is_the_real_package_with_the_same_classes():
    out = run(
        "from wbmerge.log.proto import pb\n"
        "import wandb, wandb.proto.wandb_internal_pb2\n"
        "record = pb.Record(); record.history.step.num = 7\n"
        "theirs = wandb.proto.wandb_internal_pb2.Record\n"
        "print(theirs is pb.Record, theirs.FromString(record.SerializeToString()).history.step.num,"
        " hasattr(wandb, 'init'))"
    )
    assert out == "True 7 True"


def test_wandb_imported_first_is_used_as_it_is():
    out = run(
        "import wandb\n"
        "from wandb.proto import wandb_internal_pb2\n"
        "from wbmerge.log.proto import pb\n"
        "print(pb is wandb_internal_pb2)"
    )
    assert out == "True"
