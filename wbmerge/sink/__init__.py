"""A local W&B-compatible sink: the quickstart's upload target and the tests' server."""

from .access import UploadTokens, is_loopback_host, read_api_key
from .client import SinkClient
from .faults import parse_fault
from .names import BadName, check_file_name, check_run_id, check_run_path
from .pages import index_html, run_html
from .process import LocalSink
from .protocol import ProtocolError, decode_body
from .server import serve
from .store import Store

__all__ = [
    "BadName",
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
    "names",
    "parse_fault",
    "read_api_key",
    "run_html",
    "serve",
]
