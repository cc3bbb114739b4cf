"""Tests of the `sync` stage."""
