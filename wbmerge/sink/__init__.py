"""A local W&B-compatible sink: the quickstart's upload target and the tests' server."""

from .access import read_api_key
from .client import SinkClient
from .process import LocalSink
from .store import Store

__all__ = ["LocalSink", "SinkClient", "Store", "read_api_key"]
