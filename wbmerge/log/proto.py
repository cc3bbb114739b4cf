"""wandb's `Record` protobuf classes (`pb`), without paying for `import wandb`.

The generated modules in `wandb/proto/` need nothing but protobuf, yet importing them the
usual way first runs `wandb/__init__.py`, which loads the whole SDK: 0.8 s of every
`wbmerge` command's start, for classes that take 0.05 s. When wandb is not imported yet,
we import them under bare stand-ins for the `wandb` and `wandb.proto` packages, then take
the stand-ins and the modules away again: a later `import wandb` runs the real package and
loads its modules as usual (protobuf hands it the message classes made here).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import types
from pathlib import Path

_MODULE = "wandb.proto.wandb_internal_pb2"


def _import_generated() -> types.ModuleType:
    if "wandb" in sys.modules:  # already paid for (or being imported): the usual way
        return importlib.import_module(_MODULE)
    spec = importlib.util.find_spec("wandb")  # finds the package without running it
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("wbmerge needs the wandb package: pip install wandb")
    root = list(spec.submodule_search_locations)
    stand_ins = {
        "wandb": root,
        "wandb.proto": [str(Path(location) / "proto") for location in root],
    }
    for name, locations in stand_ins.items():
        package = types.ModuleType(name)
        package.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        package.__spec__.submodule_search_locations = locations
        package.__path__ = locations
        sys.modules[name] = package
    try:
        return importlib.import_module(_MODULE)
    finally:
        for name in [n for n in sys.modules if n == "wandb" or n.startswith("wandb.")]:
            del sys.modules[name]


pb = _import_generated()


def item_path(item: pb.HistoryItem | pb.ConfigItem | pb.SummaryItem) -> list[str]:
    """A history, config or summary item's path: its nested key, else its key ([""] for
    neither, which wandb-core drops from a row). It lives with the messages because both
    the reader of steps and the model of what wandb-core sends need it."""
    return list(item.nested_key) or [item.key]
