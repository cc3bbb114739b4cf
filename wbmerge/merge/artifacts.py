"""The artifact records of a staged run, filed under the run the merge uploads.

wandb's uploader creates an artifact under the run id, project and entity written in its
`ArtifactRecord` (wandb-core's `ArtifactSaver`, not the run it is syncing: `wandb sync -p`
and `--id` do not reach artifacts). A rank's records name the rank's offline run, so
copied as they are they would make a run under that id beside the uploaded one. Each
record is rewritten here to name the target run, the project the merge uploads to (when
one is chosen) and its entity (none: the server's default, as the run's own upload).

A `run_table` artifact (the files of a logged `wandb.Table`) is named by wandb after the
run that logged it, `run-{run id}-{key}`; it is renamed after the target run, as a
one-rank online run would name it. In shared mode every rank's artifacts go to the merged
run, as W&B's online shared mode files them: the same name from two ranks makes two
versions of one artifact. A `use_artifact` record names no run (only the artifact), and
is copied as it is.
"""

from __future__ import annotations

from google.protobuf.message import DecodeError

from ..errors import WbmergeError
from ..log.proto import pb
from ..plan import Source, Target
from .options import MergeOptions

MAX_ARTIFACT_NAME = 128  # W&B's limit on an artifact's name


class ArtifactRecords:
    """Rewrites the artifact records of one target's sources (`rewrite`)."""

    def __init__(self, target: Target, options: MergeOptions) -> None:
        self.target = target
        self.options = options

    def rewrite(self, payload: bytes, source: Source) -> bytes:
        """The artifact record `payload` of `source` as the target run's."""
        try:
            record = pb.Record.FromString(payload)
        except (DecodeError, RecursionError):
            raise WbmergeError(
                f"{source.label}: an artifact record of {source.path} cannot be read"
            ) from None
        artifact = record.artifact
        artifact.run_id = self.target.id
        if self.options.project:
            artifact.project = self.options.project
        artifact.entity = self.options.entity or ""
        own_prefix = f"run-{source.run_id}-"
        if artifact.type == "run_table" and artifact.name.startswith(own_prefix):
            renamed = f"run-{self.target.id}-{artifact.name[len(own_prefix) :]}"
            if len(renamed) <= MAX_ARTIFACT_NAME:
                artifact.name = renamed
        return record.SerializeToString()
