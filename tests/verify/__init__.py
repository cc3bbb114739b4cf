"""Tests of the `verify` stage."""
