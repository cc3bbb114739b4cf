"""A local W&B-compatible sink: the quickstart's upload target and the tests' server."""

from importlib import import_module
from typing import TYPE_CHECKING

from . import wandblike
from .access import UploadTokens, is_loopback_host, read_api_key
from .client import SinkClient
from .faults import parse_fault
from .names import BadName, check_file_name, check_run_id, check_run_path
from .process import LocalSink
from .protocol import ProtocolError, decode_body
from .runfilters import FilterError, matcher
from .store import Store
from .wandblike import LikeWandb, Limits

if TYPE_CHECKING:
    from .pages import index_html, run_html
    from .server import serve

# Imported on first use: the server and its pages need aiohttp (0.3 s of a start), which a
# client of the sink, `wbmerge sink show` and `api.start_sink` do without.
_ON_FIRST_USE = {"index_html": "pages", "run_html": "pages", "serve": "server"}


def __getattr__(name: str) -> object:
    """A name of `_ON_FIRST_USE`, imported from its module when first asked for."""
    if name in _ON_FIRST_USE:
        return getattr(import_module(f".{_ON_FIRST_USE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BadName",
    "FilterError",
    "LikeWandb",
    "Limits",
    "LocalSink",
    "ProtocolError",
    "SinkClient",
    "Store",
    "UploadTokens",
    "check_file_name",
    "check_run_id",
    "check_run_path",
    "decode_body",
    "index_html",
    "is_loopback_host",
    "matcher",
    "names",
    "parse_fault",
    "read_api_key",
    "run_html",
    "serve",
    "wandblike",
]
