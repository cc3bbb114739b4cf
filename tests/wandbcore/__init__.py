"""Tests of the `wandbcore` stage."""
