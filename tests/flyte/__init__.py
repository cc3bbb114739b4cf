"""Tests of the `flyte` stage."""
