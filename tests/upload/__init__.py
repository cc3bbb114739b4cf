"""Tests of the `upload` stage."""
